"""Generated protobuf and gRPC code for rematd's v1 wire contract.

Regenerate with ``python scripts/gen_proto.py``; never edit the ``_pb2`` files.
"""

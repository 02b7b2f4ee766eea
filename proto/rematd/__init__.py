"""rematd: adaptive activation-checkpointing plans for PyTorch training.

``from rematd import client; h = client.attach(model)`` in a training loop;
``rematd serve`` for the service; ``rematd demo`` to see it work.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]

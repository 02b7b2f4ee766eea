"""How a model's training is parallel, as rematd's steps see it: one :class:`~rematd.client.parallel.base.SetUp`
per set-up (plain, DDP, FSDP2, tensor parallel, DeepSpeed ZeRO-3, pipeline stages), picked by
:mod:`rematd.client.parallel.pick`, and the agreement of the ranks that must run one plan."""

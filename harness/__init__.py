"""harness: declarative post-local SGD / model averaging on FSDP2 (see README.md).

Nothing is imported here, so `import harness.config` and tools such as
`python -m harness.report` do not load torch.distributed.
"""

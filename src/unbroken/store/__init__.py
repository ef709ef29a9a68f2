"""Store: committed generations of a run folder (`generations`), their manifests
(`manifest`), which of them to keep (`retention`), the run a folder holds (`runrecord`), and
the file-system backend every write goes through (`backends.local`)."""

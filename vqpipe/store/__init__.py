"""Artifacts on disk: the reservoir file (``reservoir``), the stages' records (``record``), checksum
manifests, atomic writes (``fsutil``), zero-copy loads and Snakemake's between-workflow cache."""

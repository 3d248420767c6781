"""Storing into Snakemake's between-workflow output cache safely (installed by workflow/rules/common.smk).

Snakemake 9.27's local cache stores an output by moving it into a temporary directory inside the
cache and then ``shutil.move(tmp, entry)``. When two workflows race to fill one entry with a
*directory* (every cached output of this workflow is one), the loser's ``shutil.move`` puts its
copy *inside* the winner's entry (``entry/<hash>/...``): measured with two clones started
together, both jobs then failed (the manifest check of the next stage saw the extra directory)
and the entry stayed poisoned for every later run. A cache directory this process cannot write
(a read-only mount) failed every job whose output was not cached yet.

This store renames with ``os.rename``, which is atomic and refuses to replace a non-empty
directory: the loser drops its copy and links the winner's entry (one provenance hash, one
deterministic artifact; the consumer verifies its manifest anyway). A cache that is not writable
is used for reading only, and a cache that fills up (ENOSPC, a quota) gets no entry: either way
the job's output stays in place and a warning says it was not cached.
"""

import errno
import os
import shutil
from pathlib import Path
from tempfile import TemporaryDirectory


def install():
    from snakemake.caching.local import OutputFileCache

    OutputFileCache.store = store


def _move_into(outputfile, tmp, logger):
    """Move the output into the cache's temporary; False (output untouched) if it cannot be copied."""
    try:
        os.rename(outputfile, tmp)  # the same file system: no copy
        return True
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
    try:
        if os.path.isdir(outputfile):
            shutil.copytree(outputfile, tmp, copy_function=shutil.copy)
        else:
            shutil.copy(outputfile, tmp)
    except OSError as e:  # ENOSPC, a quota, ...; shutil.Error lists the files (also an OSError)
        logger.warning(f"could not store {outputfile} in the output cache ({str(e)[:200]}): "
                       "it stays in the working directory and is not cached")
        return False
    if os.path.isdir(outputfile):
        shutil.rmtree(outputfile)
    else:
        os.unlink(outputfile)
    return True


async def store(self, job):
    from snakemake.exceptions import WorkflowError
    from snakemake.logging import logger

    if not os.access(self.path, os.W_OK):
        logger.warning(f"output cache {self.path} is not writable: the outputs of {job.rule.name} "
                       "stay in the working directory and are not cached")
        return
    with TemporaryDirectory(dir=self.path) as tmpdir:
        for outputfile, cachefile in await self.get_outputfiles_and_cachefiles(job):
            if not os.path.exists(outputfile):
                raise WorkflowError(f"Cannot move output file {outputfile} to cache. It does not exist.")
            tmp = Path(tmpdir) / cachefile.name
            if not _move_into(outputfile, tmp, logger):
                continue
            self.set_permissions(tmp)
            try:
                os.rename(tmp, cachefile)  # same file system now: atomic
                logger.info(f"Moved output file {outputfile} to cache.")
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not cachefile.exists():
                    raise
                logger.info(f"{cachefile} was stored by another workflow meanwhile: using that entry")
            self.symlink(cachefile, outputfile, utime=False)

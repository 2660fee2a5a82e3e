"""Work that runs the engine over many inputs and leaves files behind.

* :mod:`~exactspec.jobs.batch`: ``generate-batch`` (JSONL in, JSONL out, resumable) and :func:`generate_batch`;
* :mod:`~exactspec.jobs.distributed`: the same job, and certification's sampling, on Ray actors;
* :mod:`~exactspec.jobs.records`: run records (``--record``) and their replay.
"""

"""Batch generation and certification scaled out on Ray: one engine replica per Ray actor, its models loaded
once, shards of requests (or of certification sequences) sent to the actors and their results merged in order.

Results are the same as a local run's (:func:`exactspec.jobs.batch.generate_batch`): every request carries its own seed
and draws with the fixed gamma on its own generator, so which actor runs it and which requests share its batch
do not change its law, and in the call-size invariant mode not its tokens either. An actor that dies is restarted
and its shard retried (Ray's ``max_restarts`` / ``max_task_retries``); since the shard's results are a function
of its requests alone, a retry gives the same lines.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import asdict, replace

from exactspec.jobs.batch import BatchJobConfig, generate_batch
from exactspec.loading import PairSpec

__all__ = ["RaySampler", "ray_results"]

ACTOR_RESTARTS = 4  # a killed actor is restarted this many times, its shard retried as often


def _load(spec: dict):
    """The pair an actor holds (:class:`exactspec.loading.PairSpec`, one torch thread unless it says otherwise)."""
    spec = PairSpec(**spec)
    return replace(spec, threads=spec.threads or 1).load()


def _connect(address: str | None, workers: int) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(
            address=address,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.ERROR,
            **({} if address else {"num_cpus": workers}),
        )


class BatchWorker:
    """A Ray actor: the pair and its engine, loaded once; ``run`` generates one shard."""

    def __init__(self, spec: dict, config: BatchJobConfig) -> None:
        from exactspec.jobs.batch import build_batch_engine

        self.pair = _load(spec)
        self.config = config
        self.engine = build_batch_engine(self.pair, config)

    def run(self, requests: list[dict], first_line: int) -> list[dict]:
        return list(generate_batch(self.pair, requests, self.config, first_line, self.engine))

    def pid(self) -> int:
        import os

        return os.getpid()


def ray_results(
    spec: PairSpec,
    requests: list[dict],
    config: BatchJobConfig,
    first_line: int = 0,
    address: str | None = None,
    workers: int = 2,
    shard_size: int = 32,
) -> Iterator[dict]:
    """Results of ``requests`` in input order, from ``workers`` actors on the Ray cluster at ``address`` (None: the
    one this process is connected to, or a new local one)."""
    import ray

    _connect(address, workers)
    actor_class = ray.remote(num_cpus=1, max_restarts=ACTOR_RESTARTS, max_task_retries=ACTOR_RESTARTS)(BatchWorker)
    actors = [actor_class.remote(asdict(spec), config) for _ in range(workers)]
    shards = [
        (first_line + start, requests[start : start + shard_size]) for start in range(0, len(requests), shard_size)
    ]
    futures = [actors[k % workers].run.remote(shard, first) for k, (first, shard) in enumerate(shards)]
    try:
        for future in futures:
            yield from ray.get(future)
    finally:
        for actor in actors:
            ray.kill(actor)


class CertifyWorker:
    """A Ray actor: the pair and a :class:`exactspec.certification.certify.LocalSampler` over it."""

    def __init__(self, spec: dict, prompts: list[list[int]], config) -> None:
        from exactspec.certification.certify import LocalSampler

        self.sampler = LocalSampler(_load(spec), prompts, config)

    def run(self, config_name: str, mutant: str | None, seed: int, score_seed: int, indices: range) -> dict:
        return self.sampler(config_name, mutant, seed, score_seed, indices)


class RaySampler:
    """The certification's sampler on Ray: each call splits the sequences into one contiguous shard per actor and
    merges the scored shards in sequence order, so the tests (and their false-positive rate) are those of a local
    run. Each shard's PIT randomization has its own seed (``score_seed`` plus the shard's first sequence)."""

    def __init__(
        self, spec: PairSpec, prompts: list[list[int]], config, address: str | None = None, workers: int = 2
    ) -> None:
        import ray

        _connect(address, workers)
        actor_class = ray.remote(num_cpus=1, max_restarts=ACTOR_RESTARTS, max_task_retries=ACTOR_RESTARTS)(
            CertifyWorker
        )
        self.actors = [actor_class.remote(asdict(spec), prompts, config) for _ in range(workers)]
        self.sequences = config.sequences

    def __call__(self, config_name: str, mutant: str | None, seed: int, score_seed: int) -> dict:
        import ray

        from exactspec.certification.certify import merge_scored

        bounds = [round(k * self.sequences / len(self.actors)) for k in range(len(self.actors) + 1)]
        shards = [range(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
        futures = [
            actor.run.remote(config_name, mutant, seed, score_seed + shard.start, shard)
            for actor, shard in zip(self.actors, shards)
        ]
        try:
            parts = ray.get(futures)
        except ray.exceptions.RayTaskError as error:  # a sequence failed in a worker (a verifier guard tripped)
            raise RuntimeError(str(error.cause)) from None
        return merge_scored(parts)

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)

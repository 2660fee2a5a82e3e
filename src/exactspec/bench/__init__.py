"""Benchmarks: one prompt set, one report format, every way exactspec is measured.

* :mod:`~exactspec.bench.workloads`: the prompt sets (code, grounded, held-out code, chat) that benches,
  certification and audits draw from;
* :mod:`~exactspec.bench.report`: the report rows (a median rate, its spread, ratios within a mode and workload),
  the one table and plot writer;
* :mod:`~exactspec.bench.arms`: exactspec's arms side by side in one process (``exactspec bench`` with a draft model);
* :mod:`~exactspec.bench.peers`: exactspec against llama.cpp, one process per run (``exactspec bench`` without one);
* :mod:`~exactspec.bench.cold_start`: ``generate --gamma auto`` against fixed gammas, one fresh process per run;
* :mod:`~exactspec.bench.sweep` and :mod:`~exactspec.bench.loadtest`: the batch engine and the server under load.
"""

"""What depends on the machine and on past runs, above the pure decoding core.

* :mod:`~exactspec.tuning.machine`: the runtime, precision and thread count chosen by measuring this machine;
* :mod:`~exactspec.tuning.calibration`: the target's and the draft's call costs measured at load;
* :mod:`~exactspec.tuning.priors`: acceptance priors by pair and mode, and their disk cache;
* :mod:`~exactspec.tuning.coldstart`: the gamma policy a run starts with, from the two above.

The core (:mod:`exactspec.decoding`, :mod:`exactspec.proposers`, :mod:`exactspec.models`) never imports this package.
"""

"""Train the default target model and its distilled draft on the CPython standard library.

Run ``python -m exactspec.training --out runs/default`` (see ``--help``).
"""

from .data import HELD_OUT, held_out_files, train_files
from .pipeline import TrainArgs, export_models, run

__all__ = ["HELD_OUT", "held_out_files", "train_files", "TrainArgs", "run", "export_models"]

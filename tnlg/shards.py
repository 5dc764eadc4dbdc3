"""Deprecated home of the full-state-dict helpers: they live in :mod:`tnlg.parallel.sharding`."""

from .parallel.sharding import full_state_dict, gather_full, load_full_state_dict

__all__ = ["gather_full", "full_state_dict", "load_full_state_dict"]

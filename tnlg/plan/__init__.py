"""``tnlg plan``: memory, FLOPs and layout planner (ZeRO paper accounting, Korthikanti
activations, Narayanan FLOPs), with per-rank parameter counts from meta-device builds.

Modules: :mod:`.units` (parsing sizes), :mod:`.counts` (parameters per TP rank),
:mod:`.memory` (model states, activations), :mod:`.experts` (a mixture of experts' terms: expert memory per
EP rank, MoE activations, the all-to-all), :mod:`.flops` (FLOPs, communication, time),
:mod:`.planner` (one layout), :mod:`.search` (all layouts that fit), :mod:`.pipeline`
(per pipeline stage), :mod:`.pipeline_search` (TP x PP x DP layouts that fit), :mod:`.report`
(tables); the ``tnlg plan`` command is :mod:`tnlg.commands.plan`.
"""

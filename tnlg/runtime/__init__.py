"""The process runtime: what a tnlg job's processes need around the library.

Modules: :mod:`.launch` (torchrun-style local and multi-node launching, joining a launched job),
:mod:`.failures` (one report per failed job, peers stopped at once), :mod:`.hang` (hung collectives
reported by rank and pipeline stage, the NCCL flight recorder), :mod:`.process_exit` (leaving a
worker cleanly), :mod:`.hardware` (the bf16 matmul probe), :mod:`.spawn` (gloo processes for tests,
benchmarks and scripts).

What every process that runs a model is given (threads, the CPU heap; ``tnlg.init_parallel``) is the library's
(:mod:`tnlg.parallel.process_settings`, :mod:`tnlg.parallel.heap`): a user's own process gets it without this package.

Layering: the library (config, model, parallel, optim, data, checkpoint, eval, generation, plan,
options, interop) imports nothing from here; :mod:`tnlg.training` and :mod:`tnlg.commands` do.
"""

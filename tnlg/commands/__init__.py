"""One module per ``tnlg`` sub-command, each thin: its flags (``add_arguments``), its checks, and
``run(args)`` calling the library and the runtime. Every module is torch-free at import, so each
``tnlg COMMAND --help`` answers without importing torch; :mod:`tnlg.cli` dispatches to them.

Modules: :mod:`.pretrain` (with its options :mod:`.pretrain_args`), :mod:`.plan`, :mod:`.data`
(``train-tokenizer``, ``preprocess``, ``data``), :mod:`.convert` (``convert``, ``checkpoint``),
:mod:`.eval`, :mod:`.generate` (both on :mod:`.inference`), :mod:`.demo`.
"""

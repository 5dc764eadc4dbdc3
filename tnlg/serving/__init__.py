"""An OpenAI-compatible server over a TP x PP group (``tnlg serve``; docs/serve.md).

Modules: :mod:`.protocol` (request bodies checked, OpenAI's error shape; no torch), :mod:`.engine` (one step of
the batch on every rank: the plan, the KV cache with a length per row, the choice of the ids),
:mod:`.scheduler` (rank 0: the bounded queue, continuous batching, each token's text to its request),
:mod:`.app` (FastAPI: the endpoints, server-sent events, the chat page ``static/chat.html``) and
:mod:`.server` (the lockstep loop, the listening socket, signals). FastAPI and uvicorn are the optional
extra ``serve`` (``pip install -e ".[serve]"``); only :mod:`.app` and :func:`.server.serve_loop` import them.
"""

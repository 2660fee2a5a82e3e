"""Running the HTTP server (``exactspec serve``) over an engine from :func:`exactspec.speculator.build_engine`."""

from __future__ import annotations

import sys

__all__ = ["run_server"]


def run_server(app, host: str, port: int) -> None:
    import uvicorn

    print(f"exactspec serving on http://{host}:{port}/v1 (Ctrl-C or SIGTERM to stop)", file=sys.stderr, flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30)

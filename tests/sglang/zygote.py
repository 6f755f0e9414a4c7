"""A fork server for the SGLang driver's processes: it imports torch and SGLang's server arguments and
disaggregation modules once (about 21 CPU-seconds each time, three quarters of a driver process's start here), then
forks one child per driver process the harness asks for.

Runs in the SGLang venv: ``python zygote.py SOCKET``. One request per connection, one JSON line: ``argv`` (the
driver's arguments), ``env``, ``cwd``, ``log``, and ``script`` to run a script (as ``python SCRIPT``) instead. The
answer is ``pid N``, then ``exit CODE`` when that child ended. A child starts its own session, takes the request's
environment, working directory and log as stdout and stderr, and runs ``sglang_driver.main`` (the file beside
this one) as ``python -m`` would; kvlifecycle itself is imported in the child only, after its environment is set
(its variables are read there). Single-threaded (a fork copies no other thread's locks); it exits when the process
that started it is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import socket
import sys
import traceback

PRELOAD = ("torch", "sglang.srt.server_args", "sglang.srt.runtime_context", "sglang.srt.disaggregation.utils",
           "sglang.srt.disaggregation.base.conn", "sglang.srt.disaggregation.common.conn")
DRIVER = "sglang_driver"  # tests/sglang/sglang_driver.py, beside this file
HERE = os.path.dirname(os.path.abspath(__file__))


def run_child(request: dict) -> int:
    os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request.get("script")
    # as ``python -m`` from that directory, or ``python SCRIPT``, puts it first
    sys.path[0] = request["cwd"] if script is None else os.path.dirname(os.path.abspath(script))
    if HERE not in sys.path:  # the driver is a test module, not part of the installed package
        sys.path.insert(1, HERE)
    sys.argv = [DRIVER if script is None else script, *request["argv"]]
    try:
        if script is not None:
            import runpy

            runpy.run_path(script, run_name="__main__")
            return 0
        import importlib

        return int(importlib.import_module(DRIVER).main(request["argv"]) or 0)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 1


def serve(path: str) -> None:
    parent = os.getppid()
    for name in PRELOAD:
        __import__(name)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    print("ready", flush=True)
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        for _key, _events in selector.select(timeout=0.2):
            conn, _addr = server.accept()
            conn.settimeout(10.0)
            try:
                request = json.loads(conn.makefile("r").readline())
            except (OSError, ValueError):
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                for other in children.values():
                    other.close()
                code = run_child(request)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
            children[pid] = conn
            conn.sendall(f"pid {pid}\n".encode())
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])

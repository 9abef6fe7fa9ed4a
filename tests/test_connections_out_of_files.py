"""When ``accept()`` finds no descriptor left, the server pauses accepting and says so in one
line, with no traceback, and closes the slowest senders so that the next client gets in (a
real asyncio server under a real open-file limit, in a child process)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

CHILD = textwrap.dedent("""
    import asyncio, logging, os, resource, sys
    from mlx_dspark.serve.connections import Limits, out_of_files_handler, protocol
    from mlx_dspark import open_files
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(message)s")

    async def main():
        guarded = protocol(Limits(read_timeout=60, max_connections=10_000))
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(out_of_files_handler(guarded, room=4))
        sock = __import__("socket").socket()
        sock.bind(("127.0.0.1", 0)); sock.listen(128)
        # room for a dozen connections and no more
        n = open_files.in_use() + 12
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        server = await loop.create_server(lambda: guarded(config, server_state, {}), sock=sock)
        print(sock.getsockname()[1], flush=True)
        await asyncio.sleep(float(sys.argv[1]))

    import uvicorn
    from uvicorn.config import Config
    from uvicorn.server import ServerState
    from starlette.applications import Starlette
    config = Config(Starlette(), http="h11"); config.load()
    server_state = ServerState()
    asyncio.run(main())
""")


def test_an_exhausted_descriptor_table_is_one_warning_and_the_next_client_gets_in():
    proc = subprocess.Popen([sys.executable, "-c", CHILD, "8"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    slow = []
    try:
        for _ in range(40):         # more than the table holds: half a header each
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET / HTTP/1.1\r\nHost: local")
            slow.append(s)
        time.sleep(1.5)             # paused, then a retry that finds room
        answered = None
        deadline = time.monotonic() + 5
        while answered is None and time.monotonic() < deadline:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                c.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                answered = c.recv(12) or None
            time.sleep(0.2)
        assert answered == b"HTTP/1.1 404"      # Starlette() has no routes: answered all the same
    finally:
        for s in slow:
            s.close()
        proc.kill()
    err = proc.communicate()[1]
    assert "out of file descriptors" in err, err
    assert "Traceback" not in err and "socket.accept() out of system resource" not in err, err
    assert len([line for line in err.splitlines() if "out of file descriptors" in line]) <= 2

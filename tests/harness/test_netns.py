"""The sandbox's network (qualify/netns.py, launch/sandbox.py): as root, every engine process gets a network
namespace of its own with loopback alone, and the harness's client makes its connections inside it. Real
bwrap sandboxes, real sockets; skipped where the harness cannot enter a namespace (not root), where the
sandbox keeps the host's network and says so."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from qualify.client import _transport
from qualify.launch.sandbox import Sandbox, read_info
from qualify.netns import Netns, can_enter

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not can_enter(), reason="entering a network namespace needs CAP_SYS_ADMIN (root)"),
]

SERVER = """
import http.server, socketserver, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"inside"
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
s = socketserver.TCPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""


def _sandbox(tmp_path: Path) -> tuple[Sandbox, Path]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUALIFY_") or k == "QUALIFY_CACHE_DIR"}
    sandbox = Sandbox.for_engine("qualify.engine", gpu=False, env=env)
    assert sandbox.own_net and sandbox.describe({})["namespaces"].count("net") == 1
    scratch = tmp_path / "scratch"
    sandbox.prepare_scratch(scratch)
    return sandbox, scratch


def test_a_sandboxed_process_reaches_no_address_of_the_host(tmp_path: Path) -> None:
    sandbox, scratch = _sandbox(tmp_path)
    host = socket.create_server(("127.0.0.1", 0))  # the harness's own loopback: an API, a database
    port = host.getsockname()[1]
    probe = f"""
import json, socket
out = {{"interfaces": [n for _, n in socket.if_nameindex()]}}
for name, addr in (("host_loopback", ("127.0.0.1", {port})), ("elsewhere", ("192.0.2.1", 80))):
    try:
        socket.create_connection(addr, timeout=2).close()
        out[name] = "connected"
    except OSError as exc:
        out[name] = type(exc).__name__
print(json.dumps(out))
"""
    cmd = sandbox.command([sys.executable, "-c", probe], scratch, sandbox.engine_env({}))
    r = subprocess.run(cmd, env=sandbox.bwrap.exec_env(), capture_output=True, text=True, timeout=60)
    host.close()
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["interfaces"] == ["lo"]
    assert out["host_loopback"] == "ConnectionRefusedError"  # its loopback is not the host's
    assert out["elsewhere"] == "OSError"  # ENETUNREACH: no route out of the namespace at all


def test_the_client_connects_inside_the_engines_namespace_and_the_thread_comes_back(tmp_path: Path) -> None:
    sandbox, scratch = _sandbox(tmp_path)
    info_r, info_w = os.pipe()
    cmd = sandbox.command([sys.executable, "-c", SERVER], scratch, sandbox.engine_env({}), info_fd=info_w)
    proc = subprocess.Popen(
        cmd, env=sandbox.bwrap.exec_env(), pass_fds=(info_w,), stdout=subprocess.PIPE, text=True
    )
    os.close(info_w)
    info = read_info(info_r)
    os.close(info_r)
    try:
        assert isinstance(info, dict) and proc.stdout is not None
        port = int(proc.stdout.readline())
        ns = Netns(int(info["child-pid"]))
        assert not ns.is_hosts()
        own = os.readlink("/proc/thread-self/ns/net")
        url = f"http://127.0.0.1:{port}/"
        with httpx.Client(transport=_transport(lambda: ns), timeout=10) as inside:
            assert inside.get(url).text == "inside"
            # Many threads at once: each makes its socket inside and returns to the harness's namespace.
            seen: list[str] = []

            def one() -> None:
                r = inside.get(url, headers={"Connection": "close"})
                seen.append(f"{r.text}:{os.readlink('/proc/thread-self/ns/net') == own}")

            threads = [threading.Thread(target=one) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert seen == ["inside:True"] * 8
        assert os.readlink("/proc/thread-self/ns/net") == own
        with pytest.raises(httpx.ConnectError):  # the same address on the host's loopback is not the engine
            httpx.get(url, timeout=5)
        lost = Netns(None, "no pid to enter")
        nowhere = httpx.Client(transport=_transport(lambda: lost), timeout=5)
        with nowhere, pytest.raises(httpx.ConnectError, match="no pid to enter"):  # never the host's
            nowhere.get(url)
        ns.close()
    finally:
        proc.kill()
        proc.wait(10)


def test_the_sandbox_names_its_identity_and_its_etc_is_readable(tmp_path: Path) -> None:
    sandbox, scratch = _sandbox(tmp_path)
    probe = "import getpass, os, pwd; print(pwd.getpwuid(os.getuid()).pw_name, getpass.getuser())"
    cmd = sandbox.command([sys.executable, "-c", probe], scratch, sandbox.engine_env({}))
    r = subprocess.run(cmd, env=sandbox.bwrap.exec_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["qualify-engine"] * 2, r.stderr

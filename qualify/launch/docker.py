"""Docker launcher (docker SDK 7): the engine in a container: restart policy, memory limit, GPU requests.

It reads RestartCount (a top-level inspect field), the exit code and State.OOMKilled, and also follows the
daemon's `oom` events for the container: OOMKilled is cleared when the restart policy restarts it.
Every container carries its run id and its harness (host, boot, pid, start time) as labels: `reap_orphans`
removes those whose harness is gone (the next `qualify run --launcher docker`, or `qualify gc`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from qualify.launch.base import (
    DEFAULT_MAX_RESTARTS,
    EXIT_REFUSED,
    FAULT_ENV,
    PEER_FILE,
    EngineOptions,
    Launcher,
    LaunchError,
    LaunchStatus,
    PeerOutcome,
    RefusalOutcome,
    harness_alive,
    harness_identity,
)
from qualify.launch.monitor import CONTAINER_DIR, EngineMonitor, monitor_enabled
from qualify.shm import sweep_stale_shm

CONTAINER_PORT = "8000/tcp"
LABEL = "org.qualify.run"
HARNESS_LABEL = "org.qualify.harness"  # JSON of qualify.launch.base.harness_identity()
STOP_GRACE_S = 5
# The container's hardening (docs/SANDBOX.md), asserted through `docker inspect` in the Docker tests: an
# immutable image (read-only root), writable only tmpfs scratch, no capabilities, no privilege gain, a
# bounded process table, and no mount of anything of the host's (no data dir, no checkout).
SCRATCH_TMPFS = {"/tmp": "rw,nosuid,nodev,size=1g", "/var/lib/qualify": "rw,nosuid,nodev,size=8g"}
PIDS_LIMIT = 2048  # torch's thread pools count as processes here
SECURITY_OPT = ["no-new-privileges"]
HARDENING: dict[str, Any] = {
    "read_only": True,
    "tmpfs": SCRATCH_TMPFS,
    "cap_drop": ["ALL"],
    "security_opt": SECURITY_OPT,
    "pids_limit": PIDS_LIMIT,
}
# The peer, run by `docker exec` in the engine's container: its source and spec travel in argv (the
# image's read-only interpreter, `python -I`), never through a file the engine could rewrite first.
PEER_BOOT = (
    "import sys,json,tempfile,os\n"
    "src, spec = sys.argv[1], sys.argv[2]\n"
    "fd, path = tempfile.mkstemp(suffix='.json')\n"
    "os.write(fd, spec.encode()); os.close(fd)\n"
    "sys.argv = ['peer.py', '--spec', path]\n"
    "exec(compile(src, 'peer.py', 'exec'), {'__name__': '__main__'})\n"
)
# The engine in a container stops by itself when its harness is gone: no pipe crosses into a container, so
# the harness holds a TCP connection to this port (published on 127.0.0.1 only), says a token and sends a
# heartbeat (qualify.engine's _watch_harness_socket; the variable is read there).
WATCH_PORT = 8001
WATCH_ENV = "QUALIFY_HARNESS_WATCH"
HEARTBEAT_S = 1.0
# Harness variables that configure the engine under test travel into the container.
FORWARD_ENV_PREFIX = "QUALIFY_ENGINE_"


def _docker():  # imported lazily: the local launcher must work where the SDK cannot reach a daemon
    import docker

    return docker


def connect() -> Any:
    """A docker client, or LaunchError (one line) when the daemon cannot be reached."""
    docker = _docker()
    try:
        client = docker.from_env(timeout=60)
        client.ping()
    except docker.errors.DockerException as exc:
        raise LaunchError(
            f"cannot reach the Docker daemon ({str(exc).splitlines()[0][:160]}); "
            "start dockerd or use --launcher local"
        ) from exc
    return client


def check_image(ref: str) -> None:
    """LaunchError (one line) unless the daemon answers and holds `ref` locally (no registry is used)."""
    client = connect()
    try:
        client.images.get(ref)
    except _docker().errors.ImageNotFound as exc:
        raise LaunchError(
            f"image {ref} is not in the local Docker store; build it with docker/build-cpu-image.sh"
        ) from exc
    except _docker().errors.APIError as exc:
        raise LaunchError(f"cannot inspect image {ref}: {_explain(exc)}") from exc
    finally:
        client.close()


def reap_orphans(client: Any = None) -> list[str]:
    """Remove every qualify container whose harness is gone (killed before it could stop it); the names."""
    own = client is None
    client = client or connect()
    removed: list[str] = []
    try:
        for c in client.containers.list(all=True, filters={"label": LABEL}):
            try:
                ident = json.loads(c.labels.get(HARNESS_LABEL, ""))
            except ValueError:
                continue  # made before harness labels, or not by us: not ours to judge
            if harness_alive(ident) is False:
                with contextlib.suppress(_docker().errors.APIError):
                    c.remove(force=True)
                    removed.append(c.name)
    finally:
        if own:
            client.close()
    return removed


def device_requests(gpus: str | None) -> list[Any]:
    """`all` -> every GPU; `0,1` -> those indices; None -> no GPU request."""
    if gpus is None:
        return []
    types = _docker().types
    if gpus == "all":
        return [types.DeviceRequest(count=-1, capabilities=[["gpu"]])]
    return [types.DeviceRequest(device_ids=gpus.split(","), capabilities=[["gpu"]])]


# The launch document inside a container: in this environment variable, named to the engine as
# `serve --launch env:QUALIFY_LAUNCH` (docs/PROTOCOL.md, "Launch").
LAUNCH_ENV = "QUALIFY_LAUNCH"
LAUNCH_PATH = f"env:{LAUNCH_ENV}"
# Where the weights the harness seeded and hashed appear in every container of the run, read-only (a bind
# mount of the harness's cached copy: the weights subject), and where the seeding container writes them.
WEIGHTS_DIR = "/qualify/weights"
SEED_OUT_DIR = "/qualify/out"
WEIGHTS_STEP_TIMEOUT_S = 600.0


class DockerLauncher(Launcher):
    kind = "docker"

    def __init__(
        self,
        options: EngineOptions,
        image: str,
        run_dir: Path,
        *,
        gpus: str | None = None,
        mem_limit: str | None = None,
        max_restarts: int = DEFAULT_MAX_RESTARTS,
        env: dict[str, str] | None = None,
        engine_env: dict[str, str] | None = None,
    ) -> None:
        self.options = options
        self.image_ref = image
        self.engine_env = dict(engine_env or {})
        self.run_dir = run_dir
        self.gpus = gpus
        self.mem_limit = mem_limit
        self.max_restarts = max_restarts
        src = os.environ if env is None else env
        self.env = {k: v for k, v in src.items() if k.startswith(FORWARD_ENV_PREFIX)}
        self.env.update(self.engine_env)  # --engine-env: added on purpose, recorded in the receipt
        # The weights file handed to the engine (HandedWeights), seeded by the image's reference engine and
        # hashed by the harness; None until boot's prepare_weights, or when the engine writes its own.
        self.weights: Any = None
        self.hand_weights = True
        self.env["QUALIFY_HOME"] = "/var/lib/qualify"
        self.log_path = run_dir / "engine.log"
        self._env_source = dict(src)
        self.run_id = uuid.uuid4().hex[:12]
        self.labels = {LABEL: self.run_id, HARNESS_LABEL: json.dumps(harness_identity(), sort_keys=True)}
        self._client: Any = None
        self._image: Any = None
        self._container: Any = None
        self._url: str | None = None
        self._events: Any = None
        self._events_thread: threading.Thread | None = None
        self._oom_events = 0
        self._die_codes: list[int] = []
        self._refused = False
        self._boot_restarts = 0  # crashes before ready, restarted by the harness
        self._final: LaunchStatus | None = None
        self._running_image_id: str | None = None
        # The harness's CUDA activity monitor: its file mounted read-only, its socket in the run dir.
        self.monitor = EngineMonitor(run_dir, enabled=monitor_enabled(self._env_source))
        self._watches: list[_HarnessWatch] = []

    def _entry(self) -> list[str]:
        """What runs the engine's commands: nothing of ours when the image declares an ENTRYPOINT (a foreign
        engine's image: its entry point gets `serve ...` and `manifest`), else the reference engine."""
        image = self._image or self._resolve_image()
        declared = (image.attrs.get("Config") or {}).get("Entrypoint")
        return [] if declared else ["python", "-m", "qualify.engine"]

    def command(self, kda_backend: str | None = None, *, monitored: bool = False) -> list[str]:
        """The engine's command; `monitored`: run through the monitor file mounted at CONTAINER_DIR (only
        for an image run as `python -m qualify.engine`: the monitor cannot wrap an entry point it does not
        know)."""
        launch = LAUNCH_PATH if self.options.launch else None
        args = [*self.options.serve_args(kda_backend, launch), "--host", "0.0.0.0", "--port", "8000"]
        entry = self._entry()
        if not entry:
            return args
        if monitored:
            return ["python", f"{CONTAINER_DIR}/cupti_monitor.py", "qualify.engine", *args]
        return [*entry, *args]

    # ------------------------------------------------------------ lifecycle
    def _resolve_image(self) -> Any:
        docker = _docker()
        self._client = self._client or connect()
        try:
            return self._client.images.get(self.image_ref)
        except docker.errors.ImageNotFound as exc:
            raise LaunchError(
                f"image {self.image_ref} is not in the local Docker store; build it with "
                "docker/build-cpu-image.sh (no registry is used)"
            ) from exc

    def start(self, timeout_s: float) -> str:
        docker = _docker()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._image = self._resolve_image()
        mon_env, mon_volumes = self.monitor.docker_mount()
        kwargs: dict[str, Any] = {
            "command": self.command(monitored=self.monitor.enabled),
            "detach": True,
            "name": f"qualify-engine-{self.run_id}",
            "labels": self.labels,
            "environment": {**self.env, **mon_env, **self._launch_env(None)},
            "ipc_mode": "host",  # CUDA IPC between the engine and its KV-transfer peer
            # No daemon restarts until the engine is ready: a refusal at construction (exit 2) must not be
            # booted again, and the daemon's policy cannot tell it from a crash. The harness restarts a
            # crash before ready itself, then hands restarts to the daemon (`on-failure`) once ready.
            "restart_policy": {"Name": "no"},
            "ports": {CONTAINER_PORT: ("127.0.0.1", None), f"{WATCH_PORT}/tcp": ("127.0.0.1", None)},
            "shm_size": "1g",
            **HARDENING,
        }
        volumes = {**mon_volumes, **self._weights_volume()}
        if volumes:
            kwargs["volumes"] = volumes
        watch = _HarnessWatch(self)
        kwargs["environment"] = {**kwargs["environment"], WATCH_ENV: watch.spec}
        if self.mem_limit:
            kwargs.update(mem_limit=self.mem_limit, memswap_limit=self.mem_limit)
        if self.gpus:
            kwargs["device_requests"] = device_requests(self.gpus)
        since = int(time.time()) - 1
        try:
            self._container = self._client.containers.create(self._image.id, **kwargs)
        except docker.errors.APIError as exc:
            raise LaunchError(f"docker could not create the engine container: {_explain(exc)}") from exc
        self._follow_events(since)
        try:
            self._container.start()
            self._watches.append(watch.hold(self._container.id))
        except docker.errors.APIError as exc:
            # A GPU request without the NVIDIA runtime fails here and leaves a `created` container.
            self._remove()
            raise LaunchError(
                f"docker could not start the engine container: {_explain(exc)}{_gpu_hint(exc)}"
            ) from exc
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._container.reload()
            st = self._container.attrs["State"]
            if st["Status"] == "exited" and st.get("ExitCode") == EXIT_REFUSED:
                self._refused = True
                raise RuntimeError(
                    f"the engine refused its configuration at construction (exit {EXIT_REFUSED}, not "
                    f"restarted): {_last_line(self.logs_tail(5))}"
                )
            if st["Status"] == "exited":
                if self._boot_restarts >= self.max_restarts:
                    raise RuntimeError(
                        f"the engine container exited with code {st.get('ExitCode')} before it was ready "
                        f"({self._restarts()} restarts): {_last_line(self.logs_tail(5))}"
                    )
                self._boot_restarts += 1  # a crash before ready: boot it again, as the daemon would
                self._container.start()
                continue
            url = self._read_url()
            if url and _healthy(url):
                self._url = url
                left = self.max_restarts - self._boot_restarts
                if left > 0:  # (a MaximumRetryCount of 0 would mean no limit)
                    policy = {"Name": "on-failure", "MaximumRetryCount": left}
                    self._container.update(restart_policy=policy)
                return url
            time.sleep(0.2)
        raise TimeoutError(
            f"the engine container was not ready within {timeout_s:g} s: {_last_line(self.logs_tail(5))}"
        )

    def _read_url(self) -> str | None:
        ports = (self._container.attrs.get("NetworkSettings") or {}).get("Ports") or {}
        binding = ports.get(CONTAINER_PORT)
        if not binding:
            return None
        return f"http://127.0.0.1:{binding[0]['HostPort']}"

    def _restarts(self) -> int:
        return int(self._container.attrs.get("RestartCount", 0)) + self._boot_restarts

    def _follow_events(self, since: int) -> None:
        try:
            self._events = self._client.events(
                since=since, decode=True, filters={"container": self._container.id}
            )
        except _docker().errors.APIError:
            return

        def pump() -> None:
            with contextlib.suppress(Exception):
                for ev in self._events:
                    action = ev.get("Action") or ev.get("status")
                    if action == "oom":
                        self._oom_events += 1
                    elif action == "die":
                        code = (ev.get("Actor") or {}).get("Attributes", {}).get("exitCode")
                        if code is not None:
                            self._die_codes.append(int(code))

        self._events_thread = threading.Thread(target=pump, name="docker-events", daemon=True)
        self._events_thread.start()

    def url(self, refresh: bool = False) -> str:
        if refresh and self._container is not None:
            with contextlib.suppress(Exception):
                self._container.reload()
                self._url = self._read_url() or self._url
        if self._url is None:
            raise RuntimeError("the engine container has no published address yet")
        return self._url

    def wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                self._container.reload()
            except Exception:
                return False
            st = self._container.attrs["State"]
            if st["Status"] == "exited":
                return False
            url = self._read_url()
            if st["Status"] == "running" and url and _healthy(url):
                self._url = url
                return True
            time.sleep(0.2)
        return False

    def status(self) -> LaunchStatus:
        if self._final is not None:
            return self._final
        if self._container is None:
            return LaunchStatus(alive=False, exit_code=None, restart_count=0)
        try:
            self._container.reload()
        except Exception:
            return LaunchStatus(alive=False, exit_code=None, restart_count=0, detail={"container": "gone"})
        st = self._container.attrs["State"]
        running = st["Status"] == "running"
        # OOMKilled is reset when the restart policy restarts the container; the `oom` event is not.
        oom = bool(st.get("OOMKilled")) or self._oom_events > 0
        return LaunchStatus(
            alive=running,
            exit_code=None if running else st.get("ExitCode"),
            restart_count=self._restarts(),
            oom_killed=oom,
            detail={
                "container": self._container.short_id,
                "state": st["Status"],
                "state_oom_killed": bool(st.get("OOMKilled")),
                "oom_events": self._oom_events,
                "exit_codes": list(self._die_codes),
                "refused_at_construction": self._refused,
                "image_id": self._image.id if self._image is not None else None,
                "mem_limit": self.mem_limit,
                "log": str(self.log_path),
            },
        )

    def stop(self, grace_s: float = STOP_GRACE_S) -> LaunchStatus:
        if self._final is not None:
            return self._final
        if self._container is None:
            # Interrupted before `create` returned: the daemon may still hold a container of this run.
            self._remove_labelled()
            return self.status()
        with contextlib.suppress(Exception):
            # SIGTERM, then SIGKILL after the grace period
            self._container.stop(timeout=max(1, int(round(grace_s))))
        self._end_watches()
        time.sleep(0.3)  # let the `die` event arrive
        final = self.status()
        final.alive = False
        with contextlib.suppress(Exception):
            self.log_path.write_bytes(self._container.logs())
        if self._events is not None:
            with contextlib.suppress(Exception):
                self._events.close()
        self._remove()
        self._remove_labelled()
        self.monitor.close()
        sweep_stale_shm()  # ipc_mode=host: a killed engine's allocation files are in this host's /dev/shm
        self._final = final
        return final

    def _end_watches(self) -> None:
        for watch in self._watches:
            watch.end()
        self._watches.clear()

    def _remove(self) -> None:
        self._end_watches()
        if self._container is not None:
            with contextlib.suppress(Exception):
                self._container.remove(force=True)

    def _remove_labelled(self) -> list[str]:
        """Remove every container labelled with this run (engine or refusal probe), also one whose `create`
        call was interrupted before it returned a handle; the ids removed."""
        if self._client is None:
            return []
        removed: list[str] = []
        with contextlib.suppress(Exception):
            for c in self._client.containers.list(all=True, filters={"label": f"{LABEL}={self.run_id}"}):
                with contextlib.suppress(Exception):
                    c.remove(force=True)
                    removed.append(c.id)
        return removed

    def logs_tail(self, lines: int = 30) -> str:
        if self._container is not None and self._final is None:
            with contextlib.suppress(Exception):
                return self._container.logs(tail=lines).decode(errors="replace").strip()
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def sibling(self, options: EngineOptions, name: str) -> DockerLauncher:
        other = DockerLauncher(
            options,
            self.image_ref,
            self.run_dir / name,
            gpus=self.gpus,
            mem_limit=self.mem_limit,
            max_restarts=0,
            env=self._env_source,
            engine_env=self.engine_env,
        )
        # The same handed weights file: a reference engine compares against the weights subject.
        other.weights, other.hand_weights = self.weights, self.hand_weights
        return other

    def identity(self) -> dict[str, Any]:
        """The image as the daemon names it: the id of the image the RUNNING container was created from
        (`docker inspect` of the container, .Image), beside the reference's id and repo digests."""
        image = self._image or self._resolve_image()
        running = None
        if self._container is not None and self._final is None:
            with contextlib.suppress(Exception):
                self._container.reload()
                running = self._container.attrs.get("Image")
        if running is None:
            running = self._running_image_id
        self._running_image_id = running
        return {
            "launcher": "docker",
            "image": self.image_ref,
            "image_id": running or image.id,
            "reference_image_id": image.id,
            "running_container_image_id": running,
            "repo_digests": list(image.attrs.get("RepoDigests") or []),
        }

    def sandbox_info(self) -> dict[str, Any]:
        """The container's hardening as `docker inspect` reports it for the engine's container."""
        info: dict[str, Any] = {"enabled": True, "tool": "docker", "operator_env": dict(self.engine_env)}
        if self._container is None:
            return {**info, "asked": _json_hardening()}
        with contextlib.suppress(Exception):
            if self._final is None:
                self._container.reload()
            hc = self._container.attrs.get("HostConfig") or {}
            info.update(
                read_only_rootfs=hc.get("ReadonlyRootfs"),
                tmpfs=hc.get("Tmpfs"),
                cap_drop=hc.get("CapDrop"),
                cap_add=hc.get("CapAdd"),
                security_opt=hc.get("SecurityOpt"),
                pids_limit=hc.get("PidsLimit"),
                binds=hc.get("Binds"),
                mounts=[m.get("Source") for m in self._container.attrs.get("Mounts") or []],
                network_mode=hc.get("NetworkMode"),
                ipc_mode=hc.get("IpcMode"),
                env=sorted(
                    e.split("=", 1)[0] for e in (self._container.attrs.get("Config") or {}).get("Env") or []
                ),
            )
        return info

    def run_refusal(self, kda_backend: str, timeout_s: float) -> RefusalOutcome:
        """A SIGTERM or SIGINT while it waits raises through (RunInterrupted / KeyboardInterrupt are not
        Exceptions): an interrupted probe aborts the run and never reads as the engine's failure."""
        import requests  # the docker SDK's transport

        docker = _docker()
        image = self._image or self._resolve_image()
        cmd = self.command(kda_backend)
        env = {k: v for k, v in self.env.items() if k != FAULT_ENV}
        env.update(self._launch_env(kda_backend))
        watch = _HarnessWatch(self)
        t0 = time.monotonic()
        # Removed by the daemon when it exits, and stopped by its own watch when the harness is gone (a
        # probe that does not refuse would serve forever): nothing of it outlives a killed harness. Its
        # output is attached and its end waited for before it starts, as `docker run --rm` does.
        c = self._client.containers.create(
            image.id,
            command=cmd,
            environment={**env, WATCH_ENV: watch.spec},
            detach=True,
            labels=self.labels,
            name=f"qualify-refusal-{self.run_id}",
            **HARDENING,
            auto_remove=True,
            ports={f"{WATCH_PORT}/tcp": ("127.0.0.1", None)},
            volumes=self._weights_volume(),
        )
        ended: list[Any] = []
        chunks: list[bytes] = []

        def wait() -> None:
            try:
                ended.append(int(c.wait(timeout=timeout_s, condition="removed")["StatusCode"]))
            except requests.exceptions.RequestException:  # ReadTimeout / ConnectionError: not in time
                ended.append(None)
            except Exception as exc:  # an API error: no exit code
                ended.append(exc)

        def read() -> None:
            with contextlib.suppress(Exception):
                for chunk in c.attach(stdout=True, stderr=True, stream=True, logs=True):
                    chunks.append(chunk)

        try:
            reader = threading.Thread(target=read, name="docker-refusal-output", daemon=True)
            waiter = threading.Thread(target=wait, name="docker-refusal-wait", daemon=True)
            reader.start()
            waiter.start()
            c.start()
            self._watches.append(watch.hold(c.id))
            waiter.join(timeout_s + 10)
            reader.join(5)
            result = ended[0] if ended else None
            if isinstance(result, Exception):
                raise result
            code: int | None = result
            out = b"".join(chunks).decode(errors="replace")
        except docker.errors.APIError as exc:
            code, out = None, f"docker error: {_explain(exc)}"
        finally:
            watch.end()
            with contextlib.suppress(Exception):
                c.remove(force=True)
        return RefusalOutcome(cmd, code, time.monotonic() - t0, out)

    def _launch_env(self, kda_backend: str | None) -> dict[str, str]:
        """The launch document travels in the container's environment (`--launch env:QUALIFY_LAUNCH`): no file
        of the host's is mounted and nothing is copied into the container's filesystem; it is also kept
        beside the logs."""
        if self.options.launch is None:
            return {}
        text = self.options.launch_text(kda_backend)
        if kda_backend is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "launch.json").write_text(text)
        return {LAUNCH_ENV: text}

    def launch_paths(self, weights_name: str) -> tuple[str, str]:
        if self.weights is not None:
            return self.weights.engine_path, "/tmp/qualify-scratch"
        return f"/var/lib/qualify/weights/{weights_name}", "/tmp/qualify-scratch"

    def _weights_volume(self) -> dict[str, dict[str, str]]:
        if self.weights is None:
            return {}
        return {str(self.weights.path): {"bind": self.weights.engine_path, "mode": "ro"}}

    def prepare_weights(self, timeout_s: float = WEIGHTS_STEP_TIMEOUT_S, dtype: str | None = None) -> Any:
        """The seeded weights of this configuration, as the image's reference engine writes them (its
        `weights` verb, in a hardened container without network whose one writable mount is a folder of
        the run dir), copied into the harness's cache and hashed there: the file every container of the
        run gets read-only at WEIGHTS_DIR, and the weights subject. None when the engine refuses the
        configuration itself (its refusal is then the answer, as for the local launcher)."""
        import hashlib

        import requests  # the docker SDK's transport

        from qualify.launch.local import hand_over, keep_seeded
        from qualify.launch.sandbox import cache_dir

        if self.weights is not None:
            return self.weights
        docker = _docker()
        image = self._image = self._image or self._resolve_image()
        serve = self.options.serve_args(kda_backend="auto")  # the backend changes no weight
        if dtype is not None:
            serve += ["--dtype", dtype]
        key_src = json.dumps([serve, image.id, bool(self.gpus)])
        key = hashlib.sha256(key_src.encode()).hexdigest()[:20]
        cached = cache_dir() / "weights" / f"seeded-docker-{self.options.preset}-{key}.safetensors"
        if not cached.is_file():
            step = self.run_dir / "weights-step"
            step.mkdir(parents=True, exist_ok=True)
            os.chmod(step, 0o777)  # the container's uid writes here (no capability overrides a mode)
            cmd = [*(self._entry() or ["python", "-m", "qualify.engine"]), "weights", *serve[1:]]
            cmd += ["--out", f"{SEED_OUT_DIR}/seeded.safetensors"]
            out_mount = {"bind": SEED_OUT_DIR, "mode": "rw"}
            c = None
            try:
                c = self._client.containers.create(
                    image.id, cmd, detach=True, labels=self.labels, network_disabled=True,
                    name=f"qualify-weights-{self.run_id}", volumes={str(step): out_mount},
                    device_requests=device_requests(self.gpus), **HARDENING,
                )  # fmt: skip
                c.start()
                code: int | None = int(c.wait(timeout=timeout_s)["StatusCode"])
                tail = _last_line(c.logs(stdout=True, stderr=True).decode(errors="replace"))
            except docker.errors.APIError as exc:  # (a RequestException too) no container runs here
                shutil.rmtree(step, ignore_errors=True)
                raise LaunchError(
                    f"docker could not start the weights-seeding container: {_explain(exc)}{_gpu_hint(exc)}"
                ) from exc
            except requests.exceptions.RequestException:
                code, tail = None, f"no end within {timeout_s:g} s"
            finally:
                if c is not None:
                    with contextlib.suppress(Exception):
                        c.remove(force=True)
            made = step / "seeded.safetensors"
            if code == EXIT_REFUSED:
                shutil.rmtree(step, ignore_errors=True)
                return None
            if code != 0 or not made.is_file():
                shutil.rmtree(step, ignore_errors=True)
                raise RuntimeError(f"the harness could not seed the engine's weights (exit {code}): {tail}")
            keep_seeded(made, cached)
            shutil.rmtree(step, ignore_errors=True)
        origin = f"seeded by the image's reference engine ({image.id[:19]} weights), cached"
        self.weights = hand_over(cached, f"{WEIGHTS_DIR}/{cached.name}", origin)
        return self.weights

    def manifest(self, timeout_s: float) -> tuple[bytes | None, str, str | None]:
        """`manifest` in a throwaway container of the image (its entry point, else the reference engine's
        `python -m qualify.engine manifest`), bounded by timeout_s."""
        import requests  # the docker SDK's transport

        docker = _docker()
        text = f"docker run {self.image_ref} manifest"
        c = None
        try:
            image = self._image = self._image or self._resolve_image()
            cmd = [*self._entry(), "manifest"]
            text = f"docker run {self.image_ref} {' '.join(cmd)}"
            c = self._client.containers.create(
                image.id, cmd, detach=True, labels=self.labels,
                network_disabled=True, name=f"qualify-manifest-{self.run_id}",
            )  # fmt: skip
            c.start()
            code = int(c.wait(timeout=timeout_s)["StatusCode"])
            out = c.logs(stdout=True, stderr=False)
        except docker.errors.APIError as exc:  # first: it is a RequestException too
            return None, text, f"`{text}` failed: {_explain(exc)}"
        except requests.exceptions.RequestException:
            return None, text, f"`{text}` did not finish within {timeout_s:g} s"
        finally:
            if c is not None:
                with contextlib.suppress(Exception):
                    c.remove(force=True)
        if code != 0:
            return None, text, f"`{text}` exited with code {code}"
        return bytes(out), text, None

    def run_peer(self, spec_path: Path, timeout_s: float) -> PeerOutcome:
        """The peer by `docker exec` inside the engine container (its IPC namespace, /dev/shm and GPUs), as
        the harness's own peer file copied in, so the image under test does not supply the peer's code.
        `timeout` bounds it inside the container; a thread bounds the exec call outside."""
        if self._container is None:
            return PeerOutcome([], None, 0.0, None, "the engine container is not running")
        cmd = [
            "timeout", "-k", "2", str(max(1, math.ceil(timeout_s))),
            "python", "-I", "-c", PEER_BOOT, PEER_FILE.read_text(), spec_path.read_text(),
        ]  # fmt: skip
        t0 = time.monotonic()
        done: list[Any] = []

        def run() -> None:
            try:
                done.append(self._container.exec_run(cmd, demux=True))
            except Exception as exc:  # docker API errors end as an outcome without a report
                done.append(exc)

        worker = threading.Thread(target=run, name="docker-peer", daemon=True)
        worker.start()
        worker.join(timeout_s + 10)
        seconds = time.monotonic() - t0
        if not done:
            return PeerOutcome(
                cmd, None, seconds, None, f"docker exec did not return within {timeout_s + 10:.0f} s"
            )
        if isinstance(done[0], Exception):
            return PeerOutcome(cmd, None, seconds, None, f"docker exec failed: {_explain(done[0])}")
        code, (out, err) = done[0].exit_code, done[0].output
        lines = [ln for ln in (out or b"").splitlines() if ln.startswith(b"{")]
        exit_code = None if code in (124, 137) else code
        text = (err or b"").decode(errors="replace")
        return PeerOutcome.from_output(cmd, exit_code, seconds, lines[-1] if lines else None, text)


def _json_hardening() -> dict[str, Any]:
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in HARDENING.items()}


class _HarnessWatch:
    """The harness's side of an engine container's watch (see WATCH_PORT): a thread that holds a TCP
    connection to the container's watch port, says the token and sends a heartbeat, reconnecting after the
    engine restarts (its published port may change). When the harness dies, so does the connection."""

    def __init__(self, launcher: DockerLauncher) -> None:
        self.launcher = launcher
        self.token = secrets.token_hex(16)
        self.spec = f"{WATCH_PORT}:{self.token}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self, container_id: str) -> _HarnessWatch:
        self._thread = threading.Thread(
            target=self._run, args=(container_id,), name="docker-harness-watch", daemon=True
        )
        self._thread.start()
        return self

    def end(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _port(self, container_id: str) -> int | None:
        with contextlib.suppress(Exception):
            bindings = self.launcher._client.api.port(container_id, WATCH_PORT) or []
            for binding in bindings:
                if binding.get("HostIp") in ("127.0.0.1", "0.0.0.0", ""):
                    return int(binding["HostPort"])
        return None

    def _run(self, container_id: str) -> None:
        sock: socket.socket | None = None
        try:
            while not self._stop.is_set():
                if sock is None:
                    port = self._port(container_id)
                    if port is not None:
                        with contextlib.suppress(OSError):
                            sock = socket.create_connection(("127.0.0.1", port), timeout=2.0)
                            sock.sendall(self.token.encode() + b"\n")
                    if sock is None:
                        self._stop.wait(0.5)
                        continue
                try:
                    sock.sendall(b".")
                    # The engine never writes: readable means closed (an engine restarted, a proxy that
                    # found no listener yet), so connect again.
                    if sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b"":
                        raise ConnectionResetError
                except BlockingIOError:
                    pass
                except OSError:
                    sock.close()
                    sock = None
                    continue
                self._stop.wait(HEARTBEAT_S)
        finally:
            if sock is not None:
                sock.close()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _explain(exc: Exception) -> str:
    text = getattr(exc, "explanation", None) or str(exc)
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return str(text).splitlines()[0][:300]


def _gpu_hint(exc: Exception) -> str:
    """What to do about a GPU request the daemon cannot serve (no NVIDIA runtime), else nothing."""
    if "device driver" in _explain(exc) or "gpu" in _explain(exc).lower():
        return (
            "; this host has no NVIDIA container runtime: drop --gpus or install the NVIDIA container toolkit"
        )
    return ""


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(no output)"

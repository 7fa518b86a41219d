"""A real Kubernetes control plane as a child process: kube-apiserver and etcd from testenv/.

gpufrac's Kubernetes code is tested against the real API server, not a fake: optimistic concurrency
(409 on a stale resourceVersion), 410 Gone once etcd has compacted a watch's starting point, the
Binding subresource, RBAC with impersonation and the admission chain with webhooks all come from the
same code a cluster runs, so a test cannot pass on behaviour a fake merely guessed at. No scheduler,
controller-manager or kubelet runs: a pod stays Pending until something binds it, which is what a
scheduler test needs, and namespaces once deleted stay Terminating (no namespace controller).

The binary is ``testenv/bin/gpufrac-controlplane`` (built by ``make testenv``) or the file named by
``$GPUFRAC_CONTROLPLANE_BIN``. It chooses its own free loopback ports (the API server's listener is
held from the moment it is chosen, so two control planes never race for it), keeps its state, PKI and
``admin.kubeconfig`` in the data directory, and announces readiness with one line in its log; this
module waits for that line and for ``/readyz`` and turns every failure to start into a
``ControlPlaneError`` carrying the tail of the log.

Stopping sends SIGTERM (the API server shuts down, then etcd) and escalates to SIGKILL after a grace
period. The child is started in its own session, so a Ctrl-C meant for ``gpufrac up`` reaches it once,
through ``stop()``, and with ``--exit-with-parent`` it also stops when this process dies without
stopping it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import httpx2
from lightkube import AsyncClient, Client, KubeConfig

from gpufrac.local.featuregates import feature_gates_flag

BINARY_ENV = "GPUFRAC_CONTROLPLANE_BIN"
REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_BINARY = REPO_ROOT / "testenv" / "bin" / "gpufrac-controlplane"

_READY = re.compile(
    r"^gpufrac-controlplane: ready (?P<server>https://\S+) kubeconfig=(?P<kubeconfig>\S+) ca=(?P<ca>\S+)$",
    re.MULTILINE,
)


class ControlPlaneError(RuntimeError):
    """The control plane could not be found, did not become ready, or exited on its own."""


def find_binary() -> Path:
    """The control-plane binary: ``$GPUFRAC_CONTROLPLANE_BIN`` if set, else the one testenv builds."""
    configured = os.environ.get(BINARY_ENV)
    path = Path(configured) if configured else DEFAULT_BINARY
    if not (path.is_file() and os.access(path, os.X_OK)):
        source = f"${BINARY_ENV}" if configured else "the default location"
        raise ControlPlaneError(
            f"control-plane binary not found at {path} ({source}): run `make testenv` "
            f"(or `bash testenv/build.sh`) to build it, or point ${BINARY_ENV} at one"
        )
    return path


class ControlPlane:
    """One kube-apiserver + etcd process; a context manager that starts it and stops it.

    ``data_dir`` keeps etcd's data, the PKI and the kubeconfig; starting again on the same directory
    finds the same objects and accepts the same credentials. Without one, a temporary directory is
    used and removed on ``stop()``. ``apiserver_args`` are passed to kube-apiserver after the
    control plane's own flags, so they override them (``--etcd-compaction-interval=2s``).
    ``feature_gates`` defaults to the embedded cluster's one setting (``local.featuregates``).
    """

    def __init__(
        self,
        *,
        data_dir: Path | None = None,
        binary: Path | None = None,
        apiserver_args: Sequence[str] = (),
        feature_gates: dict[str, bool] | None = None,
        port: int = 0,
        start_timeout: float = 120.0,
        stop_timeout: float = 30.0,
    ) -> None:
        self._given_data_dir = Path(data_dir) if data_dir is not None else None
        self._binary = binary
        gates = feature_gates_flag(feature_gates)
        self._apiserver_args = ([gates] if gates else []) + list(apiserver_args)
        self._port = port
        self._start_timeout = start_timeout
        self._stop_timeout = stop_timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._data_dir: Path | None = None
        self._owns_data_dir = False
        self._log_offset = 0
        self._server: str | None = None
        self._kubeconfig: Path | None = None
        self._ca_file: Path | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> ControlPlane:
        if self._process is not None:
            raise ControlPlaneError("control plane already started")
        binary = self._binary or find_binary()
        if self._given_data_dir is not None:
            self._given_data_dir.mkdir(parents=True, exist_ok=True)
            self._data_dir = self._given_data_dir.resolve()
        else:
            self._data_dir = Path(tempfile.mkdtemp(prefix="gpufrac-controlplane-"))
            self._owns_data_dir = True
        log_path = self.log_path
        # Appending keeps the log of earlier runs on the same data directory; the offset makes the
        # ready line and error tails refer to this run only.
        self._log_offset = log_path.stat().st_size if log_path.exists() else 0
        argv = [
            str(binary),
            f"--data-dir={self._data_dir}",
            f"--port={self._port}",
            "--exit-with-parent",
        ]
        if self._apiserver_args:
            argv += ["--", *self._apiserver_args]
        with log_path.open("ab") as log:
            self._process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self._wait_ready()
        except BaseException:
            self._terminate()
            self._cleanup()
            raise
        return self

    def stop(self) -> int:
        """Stop the control plane and return its exit code (0 after a clean shutdown)."""
        if self._process is None:
            return 0
        try:
            return self._terminate()
        finally:
            self._cleanup()

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- what clients need ---------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def exit_code(self) -> int | None:
        """The exit code of a control plane that exited on its own; None while it runs."""
        return self._started_process().poll()

    @property
    def pid(self) -> int:
        return self._started_process().pid

    @property
    def data_dir(self) -> Path:
        if self._data_dir is None:
            raise ControlPlaneError("control plane not started")
        return self._data_dir

    @property
    def log_path(self) -> Path:
        return self.data_dir / "controlplane.log"

    @property
    def server(self) -> str:
        """The API server's URL, ``https://127.0.0.1:PORT``."""
        if self._server is None:
            raise ControlPlaneError("control plane not ready")
        return self._server

    @property
    def kubeconfig(self) -> Path:
        """An admin (system:masters) kubeconfig with the credentials embedded."""
        if self._kubeconfig is None:
            raise ControlPlaneError("control plane not ready")
        return self._kubeconfig

    @property
    def ca_file(self) -> Path:
        if self._ca_file is None:
            raise ControlPlaneError("control plane not ready")
        return self._ca_file

    def client(
        self,
        *,
        impersonate: str | None = None,
        groups: Sequence[str] = (),
        namespace: str | None = None,
        field_manager: str | None = None,
        timeout: float = 10.0,
    ) -> Client:
        """A synchronous lightkube client as the admin, or as ``impersonate`` (with ``groups``).

        Impersonation goes through the API server's own mechanism (``Impersonate-User`` and
        ``Impersonate-Group`` headers, authorized by RBAC), so what the impersonated identity may
        do is decided exactly as it would be for that user or service account
        (``system:serviceaccount:NS:NAME``).
        """
        transport = (
            _ImpersonatingTransport(self._ssl_context(), _impersonation_headers(impersonate, groups))
            if impersonate
            else None
        )
        return Client(
            config=self._kubeconfig_obj(),
            namespace=namespace,
            field_manager=field_manager,
            timeout=httpx2.Timeout(timeout),
            trust_env=False,
            transport=transport,
        )

    def async_client(
        self,
        *,
        impersonate: str | None = None,
        groups: Sequence[str] = (),
        namespace: str | None = None,
        field_manager: str | None = None,
        timeout: float = 10.0,
    ) -> AsyncClient:
        """The asynchronous twin of ``client()``."""
        transport = (
            _AsyncImpersonatingTransport(self._ssl_context(), _impersonation_headers(impersonate, groups))
            if impersonate
            else None
        )
        return AsyncClient(
            config=self._kubeconfig_obj(),
            namespace=namespace,
            field_manager=field_manager,
            timeout=httpx2.Timeout(timeout),
            trust_env=False,
            transport=transport,
        )

    def http(
        self, *, impersonate: str | None = None, groups: Sequence[str] = (), timeout: float = 10.0
    ) -> httpx2.Client:
        """A plain HTTP client on the API server as the admin (or ``impersonate``), relative URLs.

        For requests a typed client does not model well: ``/readyz``, or the Binding subresource,
        whose answer is a ``Status`` rather than the ``Binding`` lightkube expects to decode.
        """
        return httpx2.Client(
            base_url=self.server,
            verify=self._ssl_context(),
            headers=_impersonation_headers(impersonate, groups),
            trust_env=False,
            timeout=timeout,
        )

    def readyz(self) -> int:
        """The HTTP status of ``GET /readyz`` as the admin."""
        with self.http(timeout=5.0) as http:
            return http.get("/readyz").status_code

    def log_tail(self, *, lines: int = 40) -> str:
        """The last ``lines`` lines this run wrote to its log."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._log_offset)
                text = log.read().decode(errors="replace")
        except (OSError, ControlPlaneError):
            return ""
        return "\n".join(text.splitlines()[-lines:])

    # -- internals -----------------------------------------------------------------------------

    def _started_process(self) -> subprocess.Popen[bytes]:
        if self._process is None:
            raise ControlPlaneError("control plane not started")
        return self._process

    def _kubeconfig_obj(self) -> KubeConfig:
        return KubeConfig.from_file(self.kubeconfig)

    def _ssl_context(self) -> ssl.SSLContext:
        # The admin's certificate and key sit beside the CA in DATA_DIR/pki (testenv/controlplane/pki.go).
        pki = self.ca_file.parent
        context = ssl.create_default_context(cafile=str(self.ca_file))
        context.load_cert_chain(certfile=str(pki / "admin.crt"), keyfile=str(pki / "admin.key"))
        return context

    def _wait_ready(self) -> None:
        process = self._started_process()
        deadline = time.monotonic() + self._start_timeout
        while True:
            match = _READY.search(self._read_log())
            if match:
                self._server = match["server"]
                self._kubeconfig = Path(match["kubeconfig"])
                self._ca_file = Path(match["ca"])
                break
            code = process.poll()
            if code is not None:
                raise ControlPlaneError(
                    f"control plane exited with code {code} before it was ready; "
                    f"log ({self.log_path}):\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise ControlPlaneError(
                    f"control plane not ready after {self._start_timeout:.0f}s; "
                    f"log ({self.log_path}):\n{self.log_tail()}"
                )
            time.sleep(0.05)
        # The binary printed its ready line after /readyz answered 200 to it; asking again from here
        # checks the credentials and the address this side will use.
        while True:
            try:
                status = self.readyz()
            except httpx2.TransportError as exc:
                status = 0
                error = str(exc)
            else:
                error = f"HTTP {status}"
            if status == 200:
                return
            if time.monotonic() > deadline:
                raise ControlPlaneError(
                    f"{self.server}/readyz not ok after {self._start_timeout:.0f}s ({error}); "
                    f"log ({self.log_path}):\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def _read_log(self) -> str:
        with self.log_path.open("rb") as log:
            log.seek(self._log_offset)
            return log.read().decode(errors="replace")

    def _terminate(self) -> int:
        process = self._started_process()
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                return process.wait(timeout=self._stop_timeout)
            except subprocess.TimeoutExpired:
                process.kill()
        return process.wait()

    def _cleanup(self) -> None:
        self._process = None
        self._server = None
        if self._owns_data_dir and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None
            self._owns_data_dir = False


def _impersonation_headers(user: str | None, groups: Sequence[str]) -> list[tuple[str, str]]:
    headers = [("Impersonate-User", user)] if user else []
    return headers + [("Impersonate-Group", group) for group in groups]


class _ImpersonatingTransport(httpx2.BaseTransport):
    """Adds impersonation headers to every request; TLS as the admin, who is allowed to impersonate."""

    def __init__(self, context: ssl.SSLContext, headers: list[tuple[str, str]]) -> None:
        self._inner = httpx2.HTTPTransport(verify=context, trust_env=False)
        self._headers = headers

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        request.headers = httpx2.Headers([*request.headers.multi_items(), *self._headers])
        return self._inner.handle_request(request)

    def close(self) -> None:
        self._inner.close()


class _AsyncImpersonatingTransport(httpx2.AsyncBaseTransport):
    def __init__(self, context: ssl.SSLContext, headers: list[tuple[str, str]]) -> None:
        self._inner = httpx2.AsyncHTTPTransport(verify=context, trust_env=False)
        self._headers = headers

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        request.headers = httpx2.Headers([*request.headers.multi_items(), *self._headers])
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()

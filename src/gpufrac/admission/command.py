"""``gpufrac admission``: run the webhook server until SIGTERM.

In a cluster the certificate and key come from a Secret mounted into the Pod (``--tls-cert``,
``--tls-key``). Without them a local CA and a certificate for 127.0.0.1, localhost and ``--tls-host``
names are generated (or reused) in ``--tls-dir``, and ``--write-configuration`` writes the two webhook
configurations that point the API server at this process, CA bundle included. The certificate files are
re-read every few seconds: a rotated Secret is served to new connections without a restart.
"""

from __future__ import annotations

import logging
import signal
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer
import yaml

from gpufrac.admission.certs import LOCAL_HOSTS, CertificateError, ensure_tls
from gpufrac.admission.configuration import webhook_configurations
from gpufrac.admission.queue_book import KubeQueueBook
from gpufrac.admission.review import DEFAULT_SCHEDULER_USER, AdmissionPolicy
from gpufrac.admission.server import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS, AdmissionServer
from gpufrac.contract.keys import DEFAULT_SCHEDULER_NAME, NRI_PLUGIN_NAME, NRI_VALIDATOR_PLUGIN_NAME
from gpufrac.kube.client import connect

log = logging.getLogger(__name__)

#: How long the webhook waits, at start, for its first read of Queues and Namespaces.
QUEUE_BOOK_WAIT_S = 30.0
#: ``--tls-dir``'s default, under the temporary directory.
TLS_DIR_NAME = "gpufrac-admission-tls"


def _default_tls_dir() -> Path:
    """Asked for only when a local certificate is generated: ``gpufrac`` loads this module with every
    subcommand, and the validator's container has no writable temporary directory to give."""
    return Path(tempfile.gettempdir()) / TLS_DIR_NAME


def admission(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "0.0.0.0",
    port: Annotated[int, typer.Option(help="HTTPS port.")] = 8443,
    tls_cert: Annotated[
        Path | None, typer.Option(help="Serving certificate (PEM), e.g. from a Secret.")
    ] = None,
    tls_key: Annotated[Path | None, typer.Option(help="Key of --tls-cert (PEM).")] = None,
    max_connections: Annotated[
        int,
        typer.Option(min=1, help="Connections served at once; beyond it a new one is closed at once."),
    ] = DEFAULT_MAX_CONNECTIONS,
    idle_timeout: Annotated[
        float,
        typer.Option(
            min=0.1, help="Seconds a connection may stay silent (handshake, between or within requests)."
        ),
    ] = DEFAULT_IDLE_TIMEOUT_S,
    tls_dir: Annotated[
        Path | None,
        typer.Option(
            help="Where a local CA and certificate are kept when --tls-cert is not given "
            f"(default: {TLS_DIR_NAME} in the temporary directory).",
        ),
    ] = None,
    tls_host: Annotated[
        list[str] | None, typer.Option(help="Extra DNS name or IP for a generated certificate (repeatable).")
    ] = None,
    scheduler_name: Annotated[str, typer.Option(help="schedulerName of pods gpufrac schedules.")] = (
        DEFAULT_SCHEDULER_NAME
    ),
    scheduler_user: Annotated[
        list[str] | None,
        typer.Option(
            help=f"User allowed to write binder-owned keys (repeatable; default {DEFAULT_SCHEDULER_USER})."
        ),
    ] = None,
    translate_legacy: Annotated[
        bool,
        typer.Option(
            "--translate-legacy/--no-translate-legacy",
            help="Rewrite gpu-memory into per-container keys (off where KAI Scheduler schedules).",
        ),
    ] = True,
    set_scheduler_name: Annotated[
        bool,
        typer.Option(
            "--set-scheduler-name/--no-set-scheduler-name",
            help="Give pods that ask for a GPU fraction and name no scheduler --scheduler-name (a pod opts "
            'out with gpufrac.io/keep-scheduler-name: "true"; off where KAI Scheduler schedules).',
        ),
    ] = True,
    queue_bindings: Annotated[
        bool,
        typer.Option(
            "--queue-bindings/--no-queue-bindings",
            help="Read Queues and Namespaces from the API server (in-cluster or KUBECONFIG) and refuse a pod "
            "in a queue its namespace may not use (docs/queues.md).",
        ),
    ] = False,
    default_queue: Annotated[
        str, typer.Option(help="The scheduler's default_queue: the queue of pods that name none.")
    ] = "default",
    required_nri_plugin: Annotated[
        list[str] | None,
        typer.Option(
            help="NRI plugin every GPU container requires (repeatable; default the node agent, "
            f"{NRI_PLUGIN_NAME}); name the validator too ({NRI_VALIDATOR_PLUGIN_NAME}) where nodes run it.",
        ),
    ] = None,
    write_configuration: Annotated[
        Path | None, typer.Option(help="Write the two webhook configurations (YAML) for --webhook-url here.")
    ] = None,
    webhook_url: Annotated[
        str | None,
        typer.Option(help="URL the API server uses to reach this server (default https://127.0.0.1:PORT)."),
    ] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
    log_format: Annotated[str, typer.Option(help="json or text.")] = "json",
) -> None:
    """The admission webhook: validates GPU requests, translates legacy forms, guards binder-owned keys."""
    from gpufrac.process.logs import configure_logging

    configure_logging(component="admission", level=log_level, fmt=log_format)
    if (tls_cert is None) != (tls_key is None):
        raise typer.BadParameter("give both --tls-cert and --tls-key, or neither")
    ca_bundle: bytes | None = None
    if tls_cert is None or tls_key is None:
        files = ensure_tls(tls_dir or _default_tls_dir(), hosts=[*LOCAL_HOSTS, *(tls_host or [])])
        tls_cert, tls_key, ca_bundle = files.cert, files.key, files.ca_bundle()
        log.info("using a local CA", extra={"ca": str(files.ca_cert)})

    policy = AdmissionPolicy(
        scheduler_name=scheduler_name,
        binder_users=frozenset(scheduler_user or [DEFAULT_SCHEDULER_USER]),
        translate_legacy=translate_legacy,
        set_scheduler_name=set_scheduler_name,
        queues=_queue_book() if queue_bindings else None,
        default_queue=default_queue,
        nri_plugins=tuple(dict.fromkeys(required_nri_plugin or [NRI_PLUGIN_NAME])),
    )
    try:
        server = AdmissionServer(
            cert=tls_cert,
            key=tls_key,
            policy=policy,
            host=host,
            port=port,
            max_connections=max_connections,
            idle_timeout_s=idle_timeout,
        )
    except CertificateError as error:
        raise typer.BadParameter(str(error), param_hint="--tls-cert/--tls-key") from None

    if write_configuration is not None:
        if ca_bundle is None:
            raise typer.BadParameter("--write-configuration needs the generated local CA (omit --tls-cert)")
        configurations = webhook_configurations(
            name="gpufrac-admission",
            ca_bundle=ca_bundle,
            url=webhook_url or f"https://127.0.0.1:{server.port}",
        )
        write_configuration.write_text(yaml.safe_dump_all(configurations, sort_keys=False))

    def stop(signum: int, _frame: FrameType | None) -> None:
        log.info("stopping", extra={"signal": signal.Signals(signum).name})
        threading.Thread(target=server.stop, name="admission-stop").start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.serve_forever()
    log.info("stopped")


def _queue_book() -> KubeQueueBook:
    """The webhook's copy of Queues and Namespaces, read before the server starts (a judged pod would be
    refused until then)."""
    book = KubeQueueBook(client=connect)
    book.start()
    if not book.wait_ready(QUEUE_BOOK_WAIT_S):
        log.warning("queues and namespaces not read yet; pods are judged once they are")
    return book

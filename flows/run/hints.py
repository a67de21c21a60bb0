"""How to continue a run, in the words of where its flow was started.

An error that tells the user what to run next names the CLI (``nrl resume RUN --take-over``), or,
in a flow run created from a Prefect deployment (the UI's "Run", a schedule), the deployment's
parameters to pass (``resume=true``, ``run_id``, ``take_over=true``): a user in the UI has no
shell.

>>> resume_command("r1", "--take-over", deployed=False)
'`nrl resume r1 --take-over`'
>>> resume_command("r1", "--take-over", deployed=True)
"a run of the deployment with the parameters resume=true, run_id='r1', take_over=true"
"""

from __future__ import annotations

from typing import Any

__all__ = ["deployment_default", "from_deployment", "resume_command"]


def from_deployment() -> bool:
    """Whether this runs in a flow run created from a Prefect deployment."""
    try:
        from prefect.runtime import deployment

        return bool(deployment.id)
    except Exception:  # noqa: BLE001 - no Prefect context: the CLI's words
        return False


def deployment_default(name: str) -> Any:
    """The default value of parameter ``name`` of the deployment this flow run was created from
    (what it sends whether or not the user passed the parameter); None outside a deployment run
    or when the API cannot say."""
    try:
        from prefect.client.orchestration import get_client
        from prefect.runtime import deployment

        if not deployment.id:
            return None
        with get_client(sync_client=True) as client:
            return (client.read_deployment(deployment.id).parameters or {}).get(name)
    except Exception:  # noqa: BLE001 - no Prefect context or API: nothing known
        return None


def resume_command(run_id: str, *flags: str, deployed: bool | None = None) -> str:
    """``nrl resume RUN FLAGS`` in backquotes, or the deployment parameters doing the same
    (``--take-over`` -> ``take_over=true``); ``deployed``: default :func:`from_deployment`."""
    if deployed is None:
        deployed = from_deployment()
    if deployed:
        params = ["resume=true", f"run_id={run_id!r}", *(f"{f.lstrip('-').replace('-', '_')}=true" for f in flags)]
        return "a run of the deployment with the parameters " + ", ".join(params)
    return "`" + " ".join(["nrl resume", run_id, *flags]) + "`"

"""A real Prefect server, process work pool, `prefect deploy`, worker and `prefect deployment run --watch`."""

from __future__ import annotations

import json

import pytest
from conftest import SMALL_BATCHES
from prefect_server import create_pools_and_deploy, prefect_server

pytestmark = pytest.mark.slow


def test_deployments_run_from_a_worker_and_the_schedule_creates_runs(tmp_path, prefect_home):
    with prefect_server(tmp_path, prefect_home) as server:
        create_pools_and_deploy(server)  # the Kubernetes pool is created from the repository's template
        env = server.env
        server.worker("cpu")
        prefect = server.cli

        out = tmp_path / "run"
        params = {"config": "configs/demo.yaml", "overrides": [
            f"run.output_dir={out}", "data.demo.train=16", "data.demo.val=4", "sft.args.max_steps=2",
            "grpo.args.max_steps=1", "grpo.args.per_device_train_batch_size=4", "grpo.args.num_generations=4",
            "grpo.args.max_completion_length=8",
            "eval.max_new_tokens=8", *SMALL_BATCHES]}
        text = prefect("deployment", "run", "vlm-pipeline/manual", "--params", json.dumps(params), "--watch",
                       "--watch-timeout", "400", timeout=450)
        assert "Completed" in text, text[-2000:]
        assert (out / "export" / "model.safetensors").is_file()
        assert (out / "grpo" / "final").is_dir()

        import asyncio

        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName, FlowRunFilter
        from prefect.settings import PREFECT_API_URL, temporary_settings

        async def scheduled_runs():
            async with get_client() as client:
                for _ in range(60):  # the scheduler service fills the schedule shortly after deploy
                    runs = await client.read_flow_runs(
                        flow_run_filter=FlowRunFilter(), deployment_filter=DeploymentFilter(
                            name=DeploymentFilterName(any_=["scheduled-retrain"])))
                    if runs:
                        return runs
                    await asyncio.sleep(1)
                return []

        with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):
            runs = asyncio.run(scheduled_runs())
        assert runs and all(r.state.name == "Scheduled" for r in runs)
        assert all(r.expected_start_time.weekday() == 0 for r in runs)  # "0 3 * * 1": Mondays

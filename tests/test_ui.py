"""The Dagster UI shows the figures on a materialisation: a real webserver on the shipped code location
(workspace.yaml) against a temp instance where a figure-bearing asset was materialised by the demo's
code path; GraphQL returns the embedded PNG, and headless Chromium draws the asset's page.

Only the webserver is started (not ``dagster dev``): the daemon's default-on sensors would launch
benchmark runs in the temp instance that this test does not need. Port and polling come from
``servers.py``.
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from chromium import dump_dom, load_png, screenshot
from servers import free_port, prepare_home, wait_for

REPO = Path(__file__).resolve().parent.parent
# A figure-bearing asset that needs no capture: the SmolLM3 trajectory on the thesis's reference values.
ASSET, PARTITION = "trajectory", "smollm3-3b"

MATERIALISE = f"""
import sys
from dagster import AssetKey, DagsterInstance
from qk_assets import defs
from qk_assets.demo import Step, run_step
from qk_assets.partitions import registry, sync_instance
sync_instance(DagsterInstance.get(), registry())  # the series partition, as the registry sensor adds it
graph = defs.resolve_asset_graph()
node = graph.get(AssetKey("{ASSET}"))
keys = [k for k in graph.get_all_asset_keys() if graph.get(k).is_materializable
        and graph.get(k).partitions_def == node.partitions_def]
done = run_step(defs, DagsterInstance.get(), Step("{PARTITION}", keys), {{"qk/test": "ui"}}, "WARNING")
sys.exit(0 if (AssetKey("{ASSET}"), "{PARTITION}") in done else 1)
"""

QUERY = """
query Mats($key: AssetKeyInput!, $parts: [String!]) {
  assetOrError(assetKey: $key) {
    __typename
    ... on Asset {
      assetMaterializations(partitions: $parts, limit: 1) {
        partition runId
        metadataEntries { label __typename
          ... on MarkdownMetadataEntry { mdStr }
          ... on PathMetadataEntry { path } }
      }
    }
  }
}
"""


def server_info(url: str, proc: subprocess.Popen) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"the webserver exited with {proc.returncode}")
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status == 200


def graphql(base: str, query: str, variables: dict) -> dict:
    req = urllib.request.Request(f"{base}/graphql", data=json.dumps({"query": query, "variables": variables}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        out = json.load(resp)
    assert "errors" not in out, out["errors"]
    return out["data"]


@pytest.fixture(scope="module")
def ui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(base URL, storage root) of a webserver on the shipped workspace over a materialised temp instance."""
    tmp = tmp_path_factory.mktemp("ui")
    home = prepare_home(tmp)
    env = {**os.environ, "DAGSTER_HOME": str(home), "QK_STORAGE_ROOT": str(tmp / "storage")}
    proc = subprocess.run([sys.executable, "-c", MATERIALISE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    port = free_port()
    webserver = Path(sys.executable).parent / "dagster-webserver"
    log = open(tmp / "webserver.log", "w")  # noqa: SIM115 (closed below)
    server = subprocess.Popen([str(webserver), "-h", "127.0.0.1", "-p", str(port), "-w", "workspace.yaml"],
                              cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: server_info(f"{base}/server_info", server), timeout=240, what="the webserver",
                 on_timeout=lambda: (tmp / "webserver.log").read_text()[-4000:])
        yield base, tmp / "storage"
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)
        log.close()


@pytest.mark.slow
def test_graphql_returns_the_embedded_figures(ui: tuple[str, Path]) -> None:
    base, storage = ui
    data = graphql(base, QUERY, {"key": {"path": [ASSET]}, "parts": [PARTITION]})
    mats = data["assetOrError"]["assetMaterializations"]
    assert len(mats) == 1 and mats[0]["partition"] == PARTITION
    entries = {e["label"]: e for e in mats[0]["metadataEntries"]}
    figs = [label for label in entries if label.startswith("fig_") and not label.endswith("_path")]
    assert figs, f"no figure on the materialisation: {sorted(entries)}"
    for label in figs:
        md = entries[label]["mdStr"]
        prefix = f"![{label[4:]}](data:image/png;base64,"
        assert md.startswith(prefix) and md.endswith(")"), md[:80]
        png = base64.b64decode(md[len(prefix):-1])
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        from matplotlib.image import imread

        img = imread(io.BytesIO(png), format="png")
        assert img.shape[0] > 100 and img.shape[1] > 100 and float(np.std(img[..., :3])) > 0.05
        # the same figure is a file under the storage root
        path = Path(entries[f"{label}_path"]["path"])
        assert path.is_file() and str(path).startswith(str(storage)) and path.read_bytes() == png


@pytest.mark.slow
def test_asset_page_in_the_ui_is_drawn(ui: tuple[str, Path], tmp_path: Path) -> None:
    base, _ = ui
    url = f"{base}/assets/{ASSET}?partition={PARTITION}"
    dom = dump_dom(url, budget_ms=20000, width=1400, height=1400)
    assert "fig_ap_bias" in dom and "Show Markdown" in dom, "metadata of the materialisation not on the page"
    shot = load_png(screenshot(url, tmp_path / "asset.png", width=1400, height=1400, budget_ms=20000))
    assert shot.shape[:2] == (1400, 1400)
    assert shot.std() > 0.05, "the asset page is blank"
    # navigation column and main pane both hold drawn content (text), not a bare loading screen
    assert region_dark_fraction(shot[:, :220]) > 0.005 and region_dark_fraction(shot[:, 260:]) > 0.005


def region_dark_fraction(img: np.ndarray) -> float:
    return float((img.mean(axis=2) < 0.5).mean())

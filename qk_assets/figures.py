"""Save matplotlib figures under the storage root and show them on a materialisation."""

import base64
import io

from dagster import MetadataValue

from qk_core.io.storage import Storage


def figure_png(fig) -> bytes:
    """Render a matplotlib figure to PNG bytes and close it."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def save_figures(storage: Storage, folder: str, figures: dict[str, object]) -> dict[str, MetadataValue]:
    """Write each figure to ``figures/<folder>/<name>.png``; return metadata entries embedding them.

    ``folder`` is e.g. ``"pca/smollm2-135m"``. Returned keys: ``fig_<name>`` (inline image, visible in
    the UI) and ``fig_<name>_path`` (where the PNG lives).
    """
    meta: dict[str, MetadataValue] = {}
    for name, fig in figures.items():
        png = figure_png(fig)
        uri = storage.write_bytes(f"figures/{folder}/{name}.png", png)
        b64 = base64.b64encode(png).decode()
        meta[f"fig_{name}"] = MetadataValue.md(f"![{name}](data:image/png;base64,{b64})")
        meta[f"fig_{name}_path"] = MetadataValue.path(uri)
    return meta

"""Save matplotlib figures under the storage root and show them on a materialisation.

Each figure is a PNG file (full size, what the report links); the figures a paper would use
(:func:`qk_core.report.html.is_paper_figure`) are also saved as PDF beside it. The materialisation embeds the
PNG, scaled down to :data:`MAX_EMBED_PX` when wider: the Dagster UI shows it in a dialog 1000 px wide, which
cut off the right edge of wider figures (issue 26).
"""

import base64
import io
import struct

from dagster import MetadataValue

from qk_core.io.storage import Storage
from qk_core.report.html import Figure, is_paper_figure

#: widest embedded image (px): Dagster 1.13's metadata dialog is 1000 px wide with 20 px padding each side
#: (measured in Chromium at 1280 and 1440 px windows; tests/test_ui.py clicks it open and measures)
MAX_EMBED_PX = 960


def figure_png(fig, close: bool = True) -> bytes:
    """Render a matplotlib figure to PNG bytes (and close it)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    if close:
        plt.close(fig)
    return buf.getvalue()


def figure_pdf(fig) -> bytes:
    """The figure as PDF bytes (vector; the figure stays open)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="pdf", bbox_inches="tight")
    return buf.getvalue()


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) in pixels from a PNG's IHDR chunk; (0, 0) if it is not a PNG."""
    if len(data) < 24 or data[:8] != b"\x89PNG\r\n\x1a\n":
        return 0, 0
    return struct.unpack(">II", data[16:24])


def embed_png(png: bytes, max_width: int = MAX_EMBED_PX) -> bytes:
    """``png`` itself when at most ``max_width`` pixels wide, else scaled down to that width (same aspect)."""
    width, height = png_size(png)
    if width <= max_width:
        return png
    from PIL import Image

    img = Image.open(io.BytesIO(png))
    small = img.resize((max_width, max(1, round(height * max_width / width))), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    small.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def save_figures(storage: Storage, folder: str, figures: dict[str, object]) -> dict[str, MetadataValue]:
    """Write each figure to ``figures/<folder>/<name>.png`` (and ``.pdf`` for a paper figure); return metadata
    entries embedding them.

    ``folder`` is e.g. ``"pca/smollm2-135m"``. Returned keys: ``fig_<name>`` (inline image, visible in
    the UI, at most :data:`MAX_EMBED_PX` wide) and ``fig_<name>_path`` (where the full-size PNG lives).
    """
    meta: dict[str, MetadataValue] = {}
    for name, fig in figures.items():
        if is_paper_figure(Figure("", name, folder)):
            storage.write_bytes(f"figures/{folder}/{name}.pdf", figure_pdf(fig))
        png = figure_png(fig)
        uri = storage.write_bytes(f"figures/{folder}/{name}.png", png)
        b64 = base64.b64encode(embed_png(png)).decode()
        meta[f"fig_{name}"] = MetadataValue.md(f"![{name}](data:image/png;base64,{b64})")
        meta[f"fig_{name}_path"] = MetadataValue.path(uri)
    return meta

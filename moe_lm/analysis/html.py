"""An HTML page (Mixtral Fig. 8 style): sample text of each domain, every token coloured by its first-choice expert
in a selectable layer, the chosen experts and gate weights on hover. Self-contained (inline CSS and JS)."""

from __future__ import annotations

import html
import json

import matplotlib

matplotlib.use("Agg")
from matplotlib import colormaps  # noqa: E402


def palette(n: int) -> list[str]:
    cmap = colormaps["tab20" if n > 10 else "tab10"]
    return [matplotlib.colors.to_hex(cmap(i % cmap.N)) for i in range(n)]


def _choices(sample: dict, layer: int, t: int) -> str:
    """A token's experts in one layer, with their gate weights where the subject records them."""
    experts, weights = sample["experts"][layer][t], (sample["weights"].get(layer) or [None] * (t + 1))[t]
    if weights is None:
        return ", ".join(f"e{e}" for e in experts)
    return ", ".join(f"e{e} {w:.2f}" for e, w in zip(experts, weights, strict=True))


def routing_page(samples: list[dict], layers: list[int], n_experts: int, title: str, extra_html: str = "") -> str:
    """samples: [{"domain", "pieces": [str], "experts": {layer: [[e...]...]}, "weights": {layer: [[w...]...]}}];
    `extra_html` (already escaped) is appended after the documents."""
    colors = palette(n_experts)
    blocks = []
    for s in samples:
        spans = []
        for t, piece in enumerate(s["pieces"]):
            hover = " | ".join(f"L{layer}: " + _choices(s, layer, t) for layer in layers)
            first = {str(layer): int(s["experts"][layer][t][0]) for layer in layers}
            text = html.escape(piece.replace("\u2581", " ")).replace("\n", "↵<br>")
            spans.append(f"<span class='t' data-e='{json.dumps(first)}' title='{html.escape(hover)}'>{text}</span>")
        blocks.append(f"<h3>{html.escape(s['domain'])}</h3><div class='doc'>{''.join(spans)}</div>")
    options = "".join(f"<option value='{layer}'>layer {layer}</option>" for layer in layers)
    legend = "".join(f"<span class='key' style='background:{c}'>e{i}</span>" for i, c in enumerate(colors))
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:1.5em;max-width:70em}} .doc{{font-family:monospace;white-space:pre-wrap;
line-height:1.7;border:1px solid #ddd;padding:.6em}} .t{{border-radius:2px;padding:0 1px}} .key{{padding:2px 6px;
margin:2px;display:inline-block;font-family:monospace;color:#111}} .pref td{{padding:2px 8px;vertical-align:top;
border-bottom:1px solid #eee}}</style></head><body>
<h2>{html.escape(title)}</h2>
<p>Each token is coloured by its <b>first-choice</b> expert in the selected layer; hover for every layer's chosen
experts and gate weights.</p>
<label>Layer <select id="layer" onchange="paint()">{options}</select></label><div>{legend}</div>
{"".join(blocks)}
{extra_html}
<script>const C={json.dumps(colors)};
function paint(){{const l=document.getElementById('layer').value;
for(const s of document.querySelectorAll('.t')){{s.style.background=C[JSON.parse(s.dataset.e)[l]]+'99';}}}}
paint();</script></body></html>"""

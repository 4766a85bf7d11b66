"""The decision config of trimvlm's demo checkpoints, which ship none (and have no chat template).

The demo models were trained on `{image}{question} <ans>` with single-word answers from a small vocabulary:
the template writes every image of the state and the question first, then the state's text (its strings, in
the request's order, blanks collapsed; nothing for a state of images only), then the instructions (and, for a
choice question, `A option B option ...`, the demo's multiple-choice form), then ` <ans>` and the mark. The
labels are demo words: `yes` / `no`, the letters `A`-`F`, the digits `0`-`9`.
"""

from __future__ import annotations

DEMO_TEMPLATE = r"""
{%- macro images(x) -%}
{%- if x is mapping and x.get("type") == "image" %}<|vision_start|><|image_pad|><|vision_end|>
{%- elif x is mapping %}{% for v in x.values() %}{{ images(v) }}{% endfor %}
{%- elif x is sequence and x is not string %}{% for v in x %}{{ images(v) }}{% endfor %}
{%- endif -%}
{%- endmacro -%}
{%- macro words(x) -%}
{%- if x is none %}{% elif x is string %}{{ x }}
{%- elif x is mapping and x.get("type") == "text" %}{{ x["text"] }}
{%- elif x is mapping and x.get("type") == "image" %}
{%- elif x is mapping %}{% for v in x.values() %}{{ words(v) }} {% endfor %}
{%- elif x is sequence %}{% for v in x %}{{ words(v) }}{{ " " if v is string }}{% endfor %}
{%- else %}{{ x }}{% endif -%}
{%- endmacro -%}
{{- images(state) ~ images(question) -}}
{%- set told = (words(state) | string).split() | join(" ") -%}
{%- if told %}{{ told ~ " " }}{% endif -%}
{{- words(question.instructions) -}}
{%- if question.type == "choice" -%}
{%- for option in question.options -%}
{%- set d = question.descriptions[loop.index0] -%}
{{- " " ~ question.labels[loop.index0] ~ " " ~ (words(d) if d else option) -}}
{%- endfor -%}
{%- endif -%}
{{- " <ans><|mark|>" -}}
"""

DEMO_LABELS = {"noul": ["yes", "no"], "choice": list("ABCDEF"), "score": list("0123456789")}


def demo_decision_config():
    from transformers.decision import DecisionConfig

    return DecisionConfig(labels={k: list(v) for k, v in DEMO_LABELS.items()}, chat_template=DEMO_TEMPLATE)

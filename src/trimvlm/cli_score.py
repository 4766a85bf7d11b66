"""Readable output of `trimvlm score`."""

from __future__ import annotations

from trimvlm.terminal import Col, Sheet

COLUMNS = ["", "candidate", Col("logit", right=True, wide=True), Col("prob", right=True),
           Col("loglik sum", right=True), Col("mean", right=True, wide=True), Col("tokens", right=True),
           "matches greedy"]  # fmt: skip


def print_scores(batch, console) -> None:
    for res in batch.results:
        table = Sheet(console, res.question, COLUMNS)
        for k, c in enumerate(res.candidates):
            mark = "*" if k == res.chosen else ""
            table.row(
                mark, c.text, f"{c.logit:.4f}", f"{c.prob:.4f}", f"{c.loglik_sum:.4f}",
                f"{c.loglik_mean:.4f}", str(c.n_tokens), "yes" if c.is_greedy else "",
            )  # fmt: skip
        if res.abstain_logit is not None:
            table.row("*" if res.chosen < 0 else "", "(abstain)", f"{res.abstain_logit:.4f}",
                      f"{res.abstain_prob:.4f}", "", "", "", "")  # fmt: skip
        console.print(table)
        if res.binary_prob is not None:
            console.print(f"P(true) = {res.binary_prob:.4f}")
        console.print(f"chosen: {res.chosen_text if res.chosen >= 0 else '(abstain)'}")
        console.print("[dim]matches greedy: greedy decoding would produce this candidate (each of its tokens is the model's top choice)[/]")
    c = batch.costs
    console.print(
        f"[dim]{batch.executor} executor, {batch.tokens['executed']} of {batch.tokens['logical']} candidate "
        f"tokens executed; prefill {c.prefill_flops / 1e9:.4f} GFLOP, candidates "
        f"{c.flops.get('branch', 0) / 1e9:.4f} GFLOP, method {c.flops.get('method', 0) / 1e9:.6f} GFLOP, "
        f"{sum(c.seconds.values()) * 1e3:.0f} ms[/]"
    )

"""Budgets that follow the load (`trimvlm serve --tuned DIR --slo-ttft-ms T`; docs/serving.md, "Budgets that
follow the load", gives the model): a chat request that names no recipe runs the most accurate rung of the
ladder (the baseline, then DIR/tune.json's budget points' best recipes, most expensive first) whose predicted
time to first token fits T behind the queue now, `(waiting + 1) * P(r) + step_s`, and whose 99th percentile at
the recent arrival rate would fit T too, `P(r) + step_s + W99(rate, S(r))` (an M/D/1 queue's tail); else the
cheapest. P(r): a mean prompt's predicted prefill on rung r; S(r) = P(r) + decode_s, a request's engine time.
The measurements are exponential moving averages of what the engine ran. A request's own `recipe` always wins.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from trimvlm.errors import InputError

EWMA = 0.2  # the weight of each new measurement
WINDOW_S = 2.0  # the arrival rate: requests that followed the load in the last WINDOW_S seconds
QUANTILE = 0.99  # the sustained check bounds this percentile of the time to first token
SERVICE_CV2 = 0.0  # the squared coefficient of variation of a request's engine time (0: fixed, M/D/1)


@dataclass(frozen=True)
class Rung:
    text: str  # the recipe as the server parses it ("" for the baseline)
    label: str  # what `usage.recipe` says
    ratio: float  # its time relative to the baseline's (measured latency; else prefill FLOPs)
    accuracy: float | None  # its test accuracy in the tune report


def ladder(folder: str | Path) -> list[Rung]:
    """The baseline and the tuned folder's budget points' best recipes, most expensive first."""
    path = Path(folder) / "tune.json"
    if not path.is_file():
        raise InputError(f"--tuned {folder}: no tune.json there (a folder written by trimvlm tune --out DIR)")
    rep = json.loads(path.read_text())
    by_spec = {e["spec"]: e for e in rep["entries"]}
    base = by_spec.get("baseline", {}).get("test") or {}
    rungs = [Rung("", "baseline", 1.0, base.get("accuracy"))]
    for b in rep["budgets"]:
        if not b.get("best"):
            continue
        test = by_spec[b["best"]].get("test") or by_spec[b["best"]]["val"]
        point = ":".join(f"{axis}={value}" for axis, value in b["budget"].items())
        ratio = test["ratio"].get("latency_s") or test["ratio"]["prefill_flops"]
        rungs.append(Rung(f"tuned={Path(folder).resolve()}:{point}", f"tuned-{b['label']}", float(ratio),
                          test.get("accuracy")))  # fmt: skip
    if len(rungs) == 1:
        raise InputError(f"--tuned {folder}: no budget point has a best recipe")
    return [rungs[0], *sorted(rungs[1:], key=lambda r: -r.ratio)]


class LoadBudget:
    def __init__(self, rungs: list[Rung], slo_s: float):
        if not slo_s > 0:
            raise InputError(f"--slo-ttft-ms must be > 0, got {slo_s * 1000!r}")
        self.rungs, self.slo_s = rungs, slo_s
        self.ratio = {r.label: r.ratio for r in rungs}
        self.tokens = 0.0  # mean prompt tokens (0: nothing measured yet)
        self.s_per_token = 0.0
        self.step_s = 0.0
        self.decode_s = 0.0  # decode-step seconds per request admitted
        self._stepped = 0.0  # decode-step seconds since the last prefill
        self._arrivals: deque[float] = deque()  # when the requests of the last WINDOW_S seconds came
        self._lock = threading.Lock()  # the model thread writes, the event loop reads

    def _prefill_s(self, rung: Rung) -> float:
        """The predicted prefill seconds of one mean prompt on `rung` (under the lock)."""
        return self.tokens * self.s_per_token * rung.ratio

    def predict(self, rung: Rung, waiting: int) -> float:
        """The predicted time to first token of a request on `rung` behind `waiting` queued requests."""
        with self._lock:
            return (waiting + 1) * self._prefill_s(rung) + self.step_s

    def sustained(self, rung: Rung, rate: float) -> float:
        """The predicted QUANTILE time to first token if requests came at `rate` per second and all ran on
        `rung` (an M/G/1 queue whose service is a request's engine time; inf where it cannot keep up)."""
        with self._lock:
            prefill = self._prefill_s(rung)
            service = prefill + self.decode_s
            return prefill + self.step_s + _wait_quantile(rate * service, service)

    def choose(self, waiting: int, rate: float = 0.0) -> Rung:
        """The most accurate rung whose predicted TTFT fits the objective behind the queue now, and whose
        QUANTILE TTFT at `rate` (requests per second) fits it too; else the cheapest."""
        for rung in self.rungs:
            if self.predict(rung, waiting) <= self.slo_s and self.sustained(rung, rate) <= self.slo_s:
                return rung
        return self.rungs[-1]

    def arrived(self, now: float | None = None) -> None:
        """A request that follows the load has come (counted in the arrival rate)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._arrivals.append(now)

    def rate(self, now: float | None = None) -> float:
        """Requests that followed the load per second: those of the last WINDOW_S seconds over the time since
        the oldest of them (at least WINDOW_S / 4), so that a load that starts after a quiet spell is seen
        within a fraction of the window."""
        now = time.monotonic() if now is None else now
        with self._lock:
            while self._arrivals and self._arrivals[0] < now - WINDOW_S:
                self._arrivals.popleft()
            if not self._arrivals:
                return 0.0
            return len(self._arrivals) / max(now - self._arrivals[0], WINDOW_S / 4)

    # ---- what the engine measured ----
    def prefilled(self, label: str, requests: int, tokens: int, seconds: float) -> None:
        """A prefill of `requests` prompts, `tokens` in all, under the recipe `label`, took `seconds`."""
        if tokens <= 0 or requests <= 0:
            return
        per = seconds / (tokens * self.ratio.get(label, 1.0))
        with self._lock:
            self.tokens = _mix(self.tokens, tokens / requests)
            self.s_per_token = _mix(self.s_per_token, per)
            self.decode_s = _mix(self.decode_s, self._stepped / requests)
            self._stepped = 0.0

    def stepped(self, seconds: float) -> None:
        with self._lock:
            self.step_s = _mix(self.step_s, seconds)
            self._stepped += seconds


def _mix(old: float, new: float) -> float:
    return new if old == 0 else (1 - EWMA) * old + EWMA * new


def _wait_quantile(rho: float, service: float) -> float:
    """The QUANTILE wait of an M/G/1 queue at utilisation `rho` whose mean service time is `service`, from the
    exponential tail P(wait > t) = rho * exp(-2 * (1 - rho) * t / ((1 + SERVICE_CV2) * service))."""
    if rho >= 1:
        return math.inf
    tail = 1 - QUANTILE
    return 0.0 if rho <= tail else (1 + SERVICE_CV2) * service / (2 * (1 - rho)) * math.log(rho / tail)

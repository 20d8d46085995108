"""What ``opcheck`` reports: one ``CheckResult`` per check, gathered in an ``OpcheckReport``;
``OpcheckError`` when a check failed."""

from __future__ import annotations

import dataclasses
import textwrap

__all__ = ["CheckResult", "OpcheckError", "OpcheckReport"]


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """The outcome of one ``opcheck`` check.

    Attributes:
        name: the check's name (``"gradcheck"``, ``"vmap"`` ...).
        status: ``"PASS"``, ``"FAIL"``, ``"SKIP"`` or ``"UNRESOLVED"``: a
            finite-difference check (``gradcheck``, ``jvp``, second order) whose
            differences cannot resolve some entries to the tolerance asked (an
            ill-conditioned op), none of them wrong by more than the differences
            resolve; neither a pass nor a failure (``jaxext.GradcheckUnresolvedWarning``).
        detail: what was verified (PASS), the diagnostic (FAIL), the reason
            it does not apply (SKIP) or the entries not resolved (UNRESOLVED).
        seconds: how long it took.
    """

    name: str
    status: str
    detail: str
    seconds: float


@dataclasses.dataclass(frozen=True)
class OpcheckReport:
    """What ``jaxext.opcheck`` found: one ``CheckResult`` per check, in run order.

    ``str(report)`` is a table (check, PASS / FAIL / SKIP / UNRESOLVED, detail, and the
    count of each; UNRESOLVED is counted only where a check has it); ``bool(report)``
    is true when no check failed (an UNRESOLVED check is no failure).

    Attributes:
        op: the name of the op checked.
        results: the results, in the order the checks ran.

    Example:
        >>> import numpy as np
        >>> import jaxext
        >>> x, w = np.ones((2, 3)), np.ones((4, 3))
        >>> report = jaxext.opcheck(jaxext.linear, (x, w), checks=["forward_rule", "jit"])
        >>> print(report.statuses)
        {'forward_rule': 'PASS', 'jit': 'PASS'}
    """

    op: str
    results: tuple[CheckResult, ...]

    @property
    def statuses(self) -> dict[str, str]:
        """``{check name: "PASS" | "FAIL" | "SKIP" | "UNRESOLVED"}``."""
        return {result.name: result.status for result in self.results}

    @property
    def failed(self) -> tuple[str, ...]:
        """Names of the failed checks, in run order."""
        return tuple(r.name for r in self.results if r.status == "FAIL")

    @property
    def skipped(self) -> tuple[str, ...]:
        """Names of the skipped checks, in run order."""
        return tuple(r.name for r in self.results if r.status == "SKIP")

    @property
    def unresolved(self) -> tuple[str, ...]:
        """Names of the checks whose finite differences left entries unresolved (neither
        PASS nor FAIL; ``CheckResult``), in run order."""
        return tuple(r.name for r in self.results if r.status == "UNRESOLVED")

    def __getitem__(self, name: str) -> CheckResult:
        for result in self.results:
            if result.name == name:
                return result
        raise KeyError(f"no check named {name!r} in this report; ran {list(self.statuses)}")

    def __bool__(self) -> bool:
        return not self.failed

    def table(self, width: int = 100) -> str:
        """The report as a text table ``width`` columns wide.

        Each check's detail is its first line, wrapped onto as many lines as it needs
        (never cut: a SKIP's reason ends with its remedy); the full diagnostic of a check
        is ``report[name].detail``.
        """
        name_width = max([len("check")] + [len(r.name) for r in self.results])
        status_width = 10 if self.unresolved else 6
        lines = [
            f"opcheck {self.op}",
            f"{'check':<{name_width}}  {'result':<{status_width}}  detail",
        ]
        room = max(20, width - name_width - status_width - 4)
        indent = " " * (name_width + status_width + 4)
        for result in self.results:
            detail = result.detail.splitlines()[0] if result.detail else ""
            first, *rest = textwrap.wrap(detail, room) or [""]
            lines.append(f"{result.name:<{name_width}}  {result.status:<{status_width}}  {first}")
            lines.extend(indent + line for line in rest)
        shown = (
            ("PASS", "FAIL", "SKIP", "UNRESOLVED") if self.unresolved else ("PASS", "FAIL", "SKIP")
        )
        counts = {s: list(self.statuses.values()).count(s) for s in shown}
        lines.append(", ".join(f"{n} {s}" for s, n in counts.items()))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


class OpcheckError(AssertionError):
    """One or more ``jaxext.opcheck`` checks failed.

    The message names each failed check with its full diagnostic (the output,
    input and element for a gradient mismatch; the subset of differentiated
    inputs, the vmapped input ...), after the report's table.

    Attributes:
        report: the ``OpcheckReport`` with every result.
        failed: names of the failed checks, in run order.
    """

    def __init__(self, report: OpcheckReport) -> None:
        self.report = report
        self.failed = report.failed
        sections = [str(report), ""]
        for result in report.results:
            if result.status == "FAIL":
                sections.append(f"FAIL {result.name}:\n  " + result.detail.replace("\n", "\n  "))
        super().__init__("\n".join(sections))


# Tracebacks show the name users can import and catch (`jaxext.OpcheckError`), not this
# private module's.
OpcheckError.__module__ = "jaxext"

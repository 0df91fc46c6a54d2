"""HAMi's refusal reasons in words a person reads, next to the codes tools match on.

The scheduler explains a refusal as HAMi does, `4/4 CardInsufficientMemory` (4 of the node's 4
GPUs refused for that reason; several joined by ", "), optionally followed by figures in
parentheses. `readable()` rewrites every such item in a text as
`4 of 4 GPUs: not enough memory (CardInsufficientMemory)`, keeping the code and any figures.
Pure; used by the CLI (and by anything else that shows reasons to people).
"""

from __future__ import annotations

import re

PHRASES = {
    "CardNotHealth": "unhealthy",
    "CardCordoned": "cordoned",
    "CardTypeMismatch": "not the GPU type asked for",
    "CardUuidMismatch": "excluded by UUID",
    "NumaNotFit": "not enough GPUs on one NUMA node",
    "CardTimeSlicingExhausted": "no sharing slot left",
    "ExclusiveDeviceAllocateConflict": "held by a pod that needs it alone",
    "ResourceQuotaNotFit": "the namespace's GPU quota is used up",
    "CardInsufficientMemory": "not enough memory",
    "CardInsufficientCore": "not enough compute",
    "CardComputeUnitsExhausted": "compute fully allocated",
    "CardMigTopologyInfeasible": "no MIG layout fits",
    "NoVnpuTemplateCovers": "no Ascend vNPU template covers the request",
    "AllocatedCardsInsufficientRequest": "fit, but too few of them",
    "NodeUnregistered": "the node has registered no GPUs",
    "RequestInvalid": "the request is invalid",
}

# kube-scheduler's summary counts nodes per reason: "0/2 nodes are available: 2 4/4 Card...".
_ITEM = re.compile(r"\b(?:(\d+) )?(\d+)/(\d+) ([A-Z][A-Za-z]+)\b(?: \(([^()]*)\))?")


def _rewrite(match: re.Match[str]) -> str:
    nodes, count, total, code, figures = match.groups()
    phrase = PHRASES.get(code)
    if phrase is None:
        return match.group(0)
    detail = f"{figures}; " if figures else ""
    where = f"{nodes} node{'s' if nodes != '1' else ''}: " if nodes else ""
    return f"{where}{count} of {total} GPUs: {phrase} ({detail}{code})"


def readable(text: str) -> str:
    """Every `N/M Code` item of `text` in words, with the code kept in parentheses."""
    return _ITEM.sub(_rewrite, text)

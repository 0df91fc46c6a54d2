"""Scheduling latency from event timestamps: admission → bound → allocated → running.

Pure: events and usage samples go in (with their own timestamps), histogram observations come
out. Replaying the same event stream yields the same histograms, so a restarted metrics service
reports the values its predecessor did (DESIGN §2: the stream is the history).

The "running" point is the first usage sample that shows one of the pod's containers. Samples are
not stored on the bus, so a pod only gets a running observation when the sampler was being
listened to before the pod was allocated (`usage_since`): otherwise the first sample seen after a
restart would be mistaken for the start of the pod.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

# Seconds. Scheduling is usually sub-second; container start (image pull) can take minutes.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)

STAGES: tuple[str, ...] = (
    "admission_to_bound",
    "reserved_to_bound",
    "bound_to_allocated",
    "allocated_to_running",
    "admission_to_running",
)

# Bounds on what is remembered per pod: pods that never finish must not grow memory forever.
MAX_TRACKED_PODS = 50_000


@dataclass
class Histogram:
    """Cumulative bucket counts, sum and count, as Prometheus exposes them."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        value = max(0.0, value)
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """[(le, cumulative count)] including +Inf."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):
            running += n
            out.append((_le(bound), running))
        out.append(("+Inf", self.count))
        return out


def _le(bound: float) -> str:
    return repr(float(bound))


@dataclass
class PodTimeline:
    """When each step of one pod's life was seen (unix seconds, from the events)."""

    namespace: str
    name: str
    admitted_at: float | None = None
    reserved_at: float | None = None
    bound_at: float | None = None
    allocated_at: float | None = None
    running_at: float | None = None
    observed: set[str] = field(default_factory=set)


class LatencyTracker:
    """Per-pod timelines and one histogram per stage."""

    def __init__(self) -> None:
        self.histograms: dict[str, Histogram] = {stage: Histogram() for stage in STAGES}
        self._pods: OrderedDict[str, PodTimeline] = OrderedDict()
        # Admission often sees a pod before it has a uid (CREATE): join on namespace/name.
        self._admitted_by_name: OrderedDict[tuple[str, str], float] = OrderedDict()
        self.usage_since: float | None = None

    def admitted(self, namespace: str, name: str, pod_uid: str, at: float) -> None:
        if pod_uid:
            timeline = self._timeline(pod_uid, namespace, name)
            if timeline.admitted_at is None:
                timeline.admitted_at = at
        if name:
            self._admitted_by_name[(namespace, name)] = at
            self._admitted_by_name.move_to_end((namespace, name))
            while len(self._admitted_by_name) > MAX_TRACKED_PODS:
                self._admitted_by_name.popitem(last=False)

    def allocation(self, action: str, namespace: str, name: str, pod_uid: str, at: float) -> None:
        """An AllocationEvent: reserved / bound / allocated advance the timeline; released and
        failed end it."""
        if action in ("released", "failed"):
            self._pods.pop(pod_uid, None)
            return
        if action not in ("reserved", "bound", "allocated"):
            return
        timeline = self._timeline(pod_uid, namespace, name)
        if timeline.admitted_at is None:
            timeline.admitted_at = self._admitted_by_name.pop((namespace, name), None)
        if action == "reserved" and timeline.reserved_at is None:
            timeline.reserved_at = at
        elif action == "bound" and timeline.bound_at is None:
            timeline.bound_at = at
            self._observe(timeline, "admission_to_bound", timeline.admitted_at, at)
            self._observe(timeline, "reserved_to_bound", timeline.reserved_at, at)
        elif action == "allocated" and timeline.allocated_at is None:
            timeline.allocated_at = at
            self._observe(timeline, "bound_to_allocated", timeline.bound_at, at)

    def running(self, pod_uid: str, at: float) -> None:
        """A usage sample showed one of the pod's containers."""
        timeline = self._pods.get(pod_uid)
        if timeline is None or timeline.allocated_at is None or timeline.running_at is not None:
            return
        if self.usage_since is None or timeline.allocated_at < self.usage_since:
            return  # we were not listening when it started: the true first sample is unknown
        timeline.running_at = at
        self._observe(timeline, "allocated_to_running", timeline.allocated_at, at)
        self._observe(timeline, "admission_to_running", timeline.admitted_at, at)

    def histograms_copy(self) -> LatencyTracker:
        """A tracker holding copies of the histograms only (for reading elsewhere)."""
        copy = LatencyTracker()
        copy.histograms = {
            stage: Histogram(h.bounds, list(h.counts), h.total, h.count)
            for stage, h in self.histograms.items()
        }
        copy.usage_since = self.usage_since
        return copy

    def tracked_pods(self) -> int:
        return len(self._pods)

    def _timeline(self, pod_uid: str, namespace: str, name: str) -> PodTimeline:
        timeline = self._pods.get(pod_uid)
        if timeline is None:
            timeline = PodTimeline(namespace=namespace, name=name)
            self._pods[pod_uid] = timeline
            while len(self._pods) > MAX_TRACKED_PODS:
                self._pods.popitem(last=False)
        return timeline

    def _observe(self, timeline: PodTimeline, stage: str, start: float | None, end: float) -> None:
        if start is None or stage in timeline.observed:
            return
        timeline.observed.add(stage)
        self.histograms[stage].observe(end - start)

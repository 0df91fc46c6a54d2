"""Dynamic Resource Allocation (`resource.k8s.io/v1`) in kube-sim.

What kube-apiserver, kube-controller-manager's resourceclaim controller, kube-scheduler's
DynamicResources plugin and kubelet's DRA manager do, one module each:

- `objects.py` (and `slices.py`): the four kinds' defaults, validation, immutable fields,
  canonical quantities; `schemas.py`: their fields for strict decoding; `printers.py`: their
  `kubectl get` columns;
- `cel.py`: CEL device selectors (cel-python) with Kubernetes' quantity and semver libraries;
- `model.py`: ResourceSlices read into devices and pools, and what allocated claims hold;
- `allocator.py`: the structured allocator (pure); `requests.py`: a claim's requests read,
  tolerations, what a share consumes;
- `claims.py`: the resourceclaim controller (claims from templates, pod claim statuses,
  reservations released and claims deleted with their pod);
- `eviction.py`: the device taint eviction controller (NoExecute taints);
- `scheduling.py`: the scheduler plugin (prefilter, filter per node, reserve before the bind,
  extended-resource mapping);
- `cdi.py`: CDI spec files and a container's edits; `kubelet.py`: plugin registration through
  plugins_registry, NodePrepareResources / NodeUnprepareResources; `health.py`: the drivers'
  NodeWatchResources streams and the containers' allocatedResourcesStatus.
"""

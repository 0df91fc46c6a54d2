# ruff: noqa: E501  (a table of facts; a few entries are longer than a line)
"""The field numbers of the Kubernetes API types kubectl sends as protobuf (`kubectl create
namespace|deployment|job|quota|configmap|secret|priorityclass|poddisruptionbudget`, `kubectl
run`), for `protobuf.py`. Facts from the published `generated.proto` of k8s.io/api (core/v1,
apps/v1, batch/v1, policy/v1, scheduling/v1) and k8s.io/apimachinery (meta/v1, runtime, intstr,
resource): message → field number → (JSON name, type[, "repeated" | "map"]). A type is a proto
scalar, another message here, a special (`meta.Time`, `resource.Quantity`, `intstr.IntOrString`,
...: see protobuf.py) or "skip" (an alpha type kube-sim does not serve). Pure data.
"""

from __future__ import annotations

Field = tuple[str, str] | tuple[str, str, str]

MESSAGES: dict[str, dict[int, Field]] = {
    "apps.Deployment": {
        1: ("metadata", "meta.ObjectMeta"), 2: ("spec", "apps.DeploymentSpec"),
        3: ("status", "apps.DeploymentStatus"),
    },
    "apps.DeploymentCondition": {
        1: ("type", "string"), 2: ("status", "string"), 4: ("reason", "string"),
        5: ("message", "string"), 6: ("lastUpdateTime", "meta.Time"),
        7: ("lastTransitionTime", "meta.Time"),
    },
    "apps.DeploymentSpec": {
        1: ("replicas", "int32"), 2: ("selector", "meta.LabelSelector"),
        3: ("template", "core.PodTemplateSpec"), 4: ("strategy", "apps.DeploymentStrategy"),
        5: ("minReadySeconds", "int32"), 6: ("revisionHistoryLimit", "int32"),
        7: ("paused", "bool"), 9: ("progressDeadlineSeconds", "int32"),
    },
    "apps.DeploymentStatus": {
        1: ("observedGeneration", "int64"), 2: ("replicas", "int32"),
        3: ("updatedReplicas", "int32"), 4: ("availableReplicas", "int32"),
        5: ("unavailableReplicas", "int32"),
        6: ("conditions", "apps.DeploymentCondition", "repeated"), 7: ("readyReplicas", "int32"),
        8: ("collisionCount", "int32"), 9: ("terminatingReplicas", "int32"),
    },
    "apps.DeploymentStrategy": {
        1: ("type", "string"), 2: ("rollingUpdate", "apps.RollingUpdateDeployment"),
    },
    "apps.RollingUpdateDeployment": {
        1: ("maxUnavailable", "intstr.IntOrString"), 2: ("maxSurge", "intstr.IntOrString"),
    },
    "batch.Job": {
        1: ("metadata", "meta.ObjectMeta"), 2: ("spec", "batch.JobSpec"),
        3: ("status", "batch.JobStatus"),
    },
    "batch.JobCondition": {
        1: ("type", "string"), 2: ("status", "string"), 3: ("lastProbeTime", "meta.Time"),
        4: ("lastTransitionTime", "meta.Time"), 5: ("reason", "string"), 6: ("message", "string"),
    },
    "batch.JobSchedulingConfiguration": {
        1: ("schedulingPolicy", "k8s.io.api.scheduling.v1alpha3.WorkloadPodGroupSchedulingPolicy"),
        2: ("schedulingConstraints", "k8s.io.api.scheduling.v1alpha3.WorkloadPodGroupSchedulingConstraints"),
        3: ("disruptionMode", "k8s.io.api.scheduling.v1alpha3.WorkloadPodGroupDisruptionMode"),
        4: ("resourceClaims", "skip", "repeated"),
    },
    "batch.JobSpec": {
        1: ("parallelism", "int32"), 2: ("completions", "int32"),
        3: ("activeDeadlineSeconds", "int64"), 4: ("selector", "meta.LabelSelector"),
        5: ("manualSelector", "bool"), 6: ("template", "core.PodTemplateSpec"),
        7: ("backoffLimit", "int32"), 8: ("ttlSecondsAfterFinished", "int32"),
        9: ("completionMode", "string"), 10: ("suspend", "bool"),
        11: ("podFailurePolicy", "batch.PodFailurePolicy"), 12: ("backoffLimitPerIndex", "int32"),
        13: ("maxFailedIndexes", "int32"), 14: ("podReplacementPolicy", "string"),
        15: ("managedBy", "string"), 16: ("successPolicy", "batch.SuccessPolicy"),
        17: ("scheduling", "batch.JobSchedulingConfiguration"),
    },
    "batch.JobStatus": {
        1: ("conditions", "batch.JobCondition", "repeated"), 2: ("startTime", "meta.Time"),
        3: ("completionTime", "meta.Time"), 4: ("active", "int32"), 5: ("succeeded", "int32"),
        6: ("failed", "int32"), 7: ("completedIndexes", "string"),
        8: ("uncountedTerminatedPods", "batch.UncountedTerminatedPods"), 9: ("ready", "int32"),
        10: ("failedIndexes", "string"), 11: ("terminating", "int32"),
    },
    "batch.PodFailurePolicy": {1: ("rules", "batch.PodFailurePolicyRule", "repeated")},
    "batch.PodFailurePolicyOnExitCodesRequirement": {
        1: ("containerName", "string"), 2: ("operator", "string"),
        3: ("values", "int32", "repeated"),
    },
    "batch.PodFailurePolicyOnPodConditionsPattern": {
        1: ("type", "string"), 2: ("status", "string"),
    },
    "batch.PodFailurePolicyRule": {
        1: ("action", "string"),
        2: ("onExitCodes", "batch.PodFailurePolicyOnExitCodesRequirement"),
        3: ("onPodConditions", "batch.PodFailurePolicyOnPodConditionsPattern", "repeated"),
    },
    "batch.SuccessPolicy": {1: ("rules", "batch.SuccessPolicyRule", "repeated")},
    "batch.SuccessPolicyRule": {1: ("succeededIndexes", "string"), 2: ("succeededCount", "int32")},
    "batch.UncountedTerminatedPods": {
        1: ("succeeded", "string", "repeated"), 2: ("failed", "string", "repeated"),
    },
    "core.AWSElasticBlockStoreVolumeSource": {
        1: ("volumeID", "string"), 2: ("fsType", "string"), 3: ("partition", "int32"),
        4: ("readOnly", "bool"),
    },
    "core.Affinity": {
        1: ("nodeAffinity", "core.NodeAffinity"), 2: ("podAffinity", "core.PodAffinity"),
        3: ("podAntiAffinity", "core.PodAntiAffinity"),
    },
    "core.AppArmorProfile": {1: ("type", "string"), 2: ("localhostProfile", "string")},
    "core.AzureDiskVolumeSource": {
        1: ("diskName", "string"), 2: ("diskURI", "string"), 3: ("cachingMode", "string"),
        4: ("fsType", "string"), 5: ("readOnly", "bool"), 6: ("kind", "string"),
    },
    "core.AzureFileVolumeSource": {
        1: ("secretName", "string"), 2: ("shareName", "string"), 3: ("readOnly", "bool"),
    },
    "core.CSIVolumeSource": {
        1: ("driver", "string"), 2: ("readOnly", "bool"), 3: ("fsType", "string"),
        4: ("volumeAttributes", "string", "map"),
        5: ("nodePublishSecretRef", "core.LocalObjectReference"),
    },
    "core.Capabilities": {1: ("add", "string", "repeated"), 2: ("drop", "string", "repeated")},
    "core.CephFSVolumeSource": {
        1: ("monitors", "string", "repeated"), 2: ("path", "string"), 3: ("user", "string"),
        4: ("secretFile", "string"), 5: ("secretRef", "core.LocalObjectReference"),
        6: ("readOnly", "bool"),
    },
    "core.CinderVolumeSource": {
        1: ("volumeID", "string"), 2: ("fsType", "string"), 3: ("readOnly", "bool"),
        4: ("secretRef", "core.LocalObjectReference"),
    },
    "core.ClusterTrustBundleProjection": {
        1: ("name", "string"), 2: ("signerName", "string"),
        3: ("labelSelector", "meta.LabelSelector"), 4: ("path", "string"), 5: ("optional", "bool"),
        6: ("user", "int64"),
    },
    "core.ConfigMap": {
        1: ("metadata", "meta.ObjectMeta"), 2: ("data", "string", "map"),
        3: ("binaryData", "bytes", "map"), 4: ("immutable", "bool"),
    },
    "core.ConfigMapEnvSource": {
        1: ("localObjectReference", "core.LocalObjectReference"), 2: ("optional", "bool"),
    },
    "core.ConfigMapKeySelector": {
        1: ("localObjectReference", "core.LocalObjectReference"), 2: ("key", "string"),
        3: ("optional", "bool"),
    },
    "core.ConfigMapProjection": {
        1: ("localObjectReference", "core.LocalObjectReference"),
        2: ("items", "core.KeyToPath", "repeated"), 4: ("optional", "bool"),
    },
    "core.ConfigMapVolumeSource": {
        1: ("localObjectReference", "core.LocalObjectReference"),
        2: ("items", "core.KeyToPath", "repeated"), 3: ("defaultMode", "int32"),
        4: ("optional", "bool"), 5: ("defaultUser", "int64"),
    },
    "core.Container": {
        1: ("name", "string"), 2: ("image", "string"), 3: ("command", "string", "repeated"),
        4: ("args", "string", "repeated"), 5: ("workingDir", "string"),
        6: ("ports", "core.ContainerPort", "repeated"), 7: ("env", "core.EnvVar", "repeated"),
        8: ("resources", "core.ResourceRequirements"),
        9: ("volumeMounts", "core.VolumeMount", "repeated"), 10: ("livenessProbe", "core.Probe"),
        11: ("readinessProbe", "core.Probe"), 12: ("lifecycle", "core.Lifecycle"),
        13: ("terminationMessagePath", "string"), 14: ("imagePullPolicy", "string"),
        15: ("securityContext", "core.SecurityContext"), 16: ("stdin", "bool"),
        17: ("stdinOnce", "bool"), 18: ("tty", "bool"),
        19: ("envFrom", "core.EnvFromSource", "repeated"),
        20: ("terminationMessagePolicy", "string"),
        21: ("volumeDevices", "core.VolumeDevice", "repeated"), 22: ("startupProbe", "core.Probe"),
        23: ("resizePolicy", "core.ContainerResizePolicy", "repeated"),
        24: ("restartPolicy", "string"),
        25: ("restartPolicyRules", "core.ContainerRestartRule", "repeated"),
    },
    "core.ContainerExtendedResourceRequest": {
        1: ("containerName", "string"), 2: ("resourceName", "string"),
        3: ("requestName", "string"),
    },
    "core.ContainerPort": {
        1: ("name", "string"), 2: ("hostPort", "int32"), 3: ("containerPort", "int32"),
        4: ("protocol", "string"), 5: ("hostIP", "string"),
    },
    "core.ContainerResizePolicy": {1: ("resourceName", "string"), 2: ("restartPolicy", "string")},
    "core.ContainerRestartRule": {
        1: ("action", "string"), 2: ("exitCodes", "core.ContainerRestartRuleOnExitCodes"),
    },
    "core.ContainerRestartRuleOnExitCodes": {
        1: ("operator", "string"), 2: ("values", "int32", "repeated"),
    },
    "core.ContainerState": {
        1: ("waiting", "core.ContainerStateWaiting"), 2: ("running", "core.ContainerStateRunning"),
        3: ("terminated", "core.ContainerStateTerminated"),
    },
    "core.ContainerStateRunning": {1: ("startedAt", "meta.Time")},
    "core.ContainerStateTerminated": {
        1: ("exitCode", "int32"), 2: ("signal", "int32"), 3: ("reason", "string"),
        4: ("message", "string"), 5: ("startedAt", "meta.Time"), 6: ("finishedAt", "meta.Time"),
        7: ("containerID", "string"),
    },
    "core.ContainerStateWaiting": {1: ("reason", "string"), 2: ("message", "string")},
    "core.ContainerStatus": {
        1: ("name", "string"), 2: ("state", "core.ContainerState"),
        3: ("lastState", "core.ContainerState"), 4: ("ready", "bool"),
        5: ("restartCount", "int32"), 6: ("image", "string"), 7: ("imageID", "string"),
        8: ("containerID", "string"), 9: ("started", "bool"),
        10: ("allocatedResources", "resource.Quantity", "map"),
        11: ("resources", "core.ResourceRequirements"),
        12: ("volumeMounts", "core.VolumeMountStatus", "repeated"),
        13: ("user", "core.ContainerUser"),
        14: ("allocatedResourcesStatus", "core.ResourceStatus", "repeated"),
        15: ("stopSignal", "string"),
    },
    "core.ContainerUser": {1: ("linux", "core.LinuxContainerUser")},
    "core.DownwardAPIProjection": {1: ("items", "core.DownwardAPIVolumeFile", "repeated")},
    "core.DownwardAPIVolumeFile": {
        1: ("path", "string"), 2: ("fieldRef", "core.ObjectFieldSelector"),
        3: ("resourceFieldRef", "core.ResourceFieldSelector"), 4: ("mode", "int32"),
        5: ("user", "int64"),
    },
    "core.DownwardAPIVolumeSource": {
        1: ("items", "core.DownwardAPIVolumeFile", "repeated"), 2: ("defaultMode", "int32"),
        3: ("defaultUser", "int64"),
    },
    "core.EmptyDirVolumeSource": {
        1: ("medium", "string"), 2: ("sizeLimit", "resource.Quantity"), 3: ("mode", "int32"),
    },
    "core.EnvFromSource": {
        1: ("prefix", "string"), 2: ("configMapRef", "core.ConfigMapEnvSource"),
        3: ("secretRef", "core.SecretEnvSource"),
    },
    "core.EnvVar": {
        1: ("name", "string"), 2: ("value", "string"), 3: ("valueFrom", "core.EnvVarSource"),
    },
    "core.EnvVarSource": {
        1: ("fieldRef", "core.ObjectFieldSelector"),
        2: ("resourceFieldRef", "core.ResourceFieldSelector"),
        3: ("configMapKeyRef", "core.ConfigMapKeySelector"),
        4: ("secretKeyRef", "core.SecretKeySelector"), 5: ("fileKeyRef", "core.FileKeySelector"),
    },
    "core.EphemeralContainer": {
        1: ("ephemeralContainerCommon", "core.EphemeralContainerCommon"),
        2: ("targetContainerName", "string"),
    },
    "core.EphemeralVolumeSource": {
        1: ("volumeClaimTemplate", "core.PersistentVolumeClaimTemplate"),
    },
    "core.EvictionResponder": {1: ("name", "string"), 2: ("priority", "int32")},
    "core.ExecAction": {1: ("command", "string", "repeated")},
    "core.FCVolumeSource": {
        1: ("targetWWNs", "string", "repeated"), 2: ("lun", "int32"), 3: ("fsType", "string"),
        4: ("readOnly", "bool"), 5: ("wwids", "string", "repeated"),
    },
    "core.FileKeySelector": {
        1: ("volumeName", "string"), 2: ("path", "string"), 3: ("key", "string"),
        4: ("optional", "bool"),
    },
    "core.FlexVolumeSource": {
        1: ("driver", "string"), 2: ("fsType", "string"),
        3: ("secretRef", "core.LocalObjectReference"), 4: ("readOnly", "bool"),
        5: ("options", "string", "map"),
    },
    "core.FlockerVolumeSource": {1: ("datasetName", "string"), 2: ("datasetUUID", "string")},
    "core.GCEPersistentDiskVolumeSource": {
        1: ("pdName", "string"), 2: ("fsType", "string"), 3: ("partition", "int32"),
        4: ("readOnly", "bool"),
    },
    "core.GRPCAction": {1: ("port", "int32"), 2: ("service", "string"), 3: ("mode", "string")},
    "core.GitRepoVolumeSource": {
        1: ("repository", "string"), 2: ("revision", "string"), 3: ("directory", "string"),
    },
    "core.GlusterfsVolumeSource": {
        1: ("endpoints", "string"), 2: ("path", "string"), 3: ("readOnly", "bool"),
    },
    "core.HTTPGetAction": {
        1: ("path", "string"), 2: ("port", "intstr.IntOrString"), 3: ("host", "string"),
        4: ("scheme", "string"), 5: ("httpHeaders", "core.HTTPHeader", "repeated"),
        6: ("protocol", "string"),
    },
    "core.HTTPHeader": {1: ("name", "string"), 2: ("value", "string")},
    "core.HostAlias": {1: ("ip", "string"), 2: ("hostnames", "string", "repeated")},
    "core.HostIP": {1: ("ip", "string")},
    "core.HostPathVolumeSource": {1: ("path", "string"), 2: ("type", "string")},
    "core.ISCSIVolumeSource": {
        1: ("targetPortal", "string"), 2: ("iqn", "string"), 3: ("lun", "int32"),
        4: ("iscsiInterface", "string"), 5: ("fsType", "string"), 6: ("readOnly", "bool"),
        7: ("portals", "string", "repeated"), 8: ("chapAuthDiscovery", "bool"),
        10: ("secretRef", "core.LocalObjectReference"), 11: ("chapAuthSession", "bool"),
        12: ("initiatorName", "string"),
    },
    "core.ImageVolumeSource": {1: ("reference", "string"), 2: ("pullPolicy", "string")},
    "core.ImageVolumeStatus": {1: ("imageRef", "string")},
    "core.KeyToPath": {
        1: ("key", "string"), 2: ("path", "string"), 3: ("mode", "int32"), 4: ("user", "int64"),
    },
    "core.Lifecycle": {
        1: ("postStart", "core.LifecycleHandler"), 2: ("preStop", "core.LifecycleHandler"),
        3: ("stopSignal", "string"),
    },
    "core.LifecycleHandler": {
        1: ("exec", "core.ExecAction"), 2: ("httpGet", "core.HTTPGetAction"),
        3: ("tcpSocket", "core.TCPSocketAction"), 4: ("sleep", "core.SleepAction"),
    },
    "core.LinuxContainerUser": {
        1: ("uid", "int64"), 2: ("gid", "int64"), 3: ("supplementalGroups", "int64", "repeated"),
    },
    "core.LocalObjectReference": {1: ("name", "string")},
    "core.NFSVolumeSource": {
        1: ("server", "string"), 2: ("path", "string"), 3: ("readOnly", "bool"),
    },
    "core.Namespace": {
        1: ("metadata", "meta.ObjectMeta"), 2: ("spec", "core.NamespaceSpec"),
        3: ("status", "core.NamespaceStatus"),
    },
    "core.NamespaceCondition": {
        1: ("type", "string"), 2: ("status", "string"), 4: ("lastTransitionTime", "meta.Time"),
        5: ("reason", "string"), 6: ("message", "string"),
    },
    "core.NamespaceSpec": {1: ("finalizers", "string", "repeated")},
    "core.NamespaceStatus": {
        1: ("phase", "string"), 2: ("conditions", "core.NamespaceCondition", "repeated"),
    },
    "core.NodeAffinity": {
        1: ("requiredDuringSchedulingIgnoredDuringExecution", "core.NodeSelector"),
        2: ("preferredDuringSchedulingIgnoredDuringExecution", "core.PreferredSchedulingTerm", "repeated"),
    },
    "core.NodeAllocatableMappedResources": {
        1: ("name", "string"), 2: ("quantity", "resource.Quantity"),
    },
    "core.NodeAllocatableOverheadResources": {
        1: ("name", "string"), 2: ("perPod", "resource.Quantity"),
        3: ("perContainer", "resource.Quantity"),
    },
    "core.NodeAllocatableResourceClaimStatus": {
        1: ("resourceClaimName", "string"), 2: ("containers", "string", "repeated"),
        4: ("mapping", "core.NodeAllocatableMappedResources", "repeated"),
        5: ("overhead", "core.NodeAllocatableOverheadResources", "repeated"),
    },
    "core.NodeSelector": {1: ("nodeSelectorTerms", "core.NodeSelectorTerm", "repeated")},
    "core.NodeSelectorRequirement": {
        1: ("key", "string"), 2: ("operator", "string"), 3: ("values", "string", "repeated"),
    },
    "core.NodeSelectorTerm": {
        1: ("matchExpressions", "core.NodeSelectorRequirement", "repeated"),
        2: ("matchFields", "core.NodeSelectorRequirement", "repeated"),
    },
    "core.ObjectFieldSelector": {1: ("apiVersion", "string"), 2: ("fieldPath", "string")},
    "core.PersistentVolumeClaimSpec": {
        1: ("accessModes", "string", "repeated"),
        2: ("resources", "core.VolumeResourceRequirements"), 3: ("volumeName", "string"),
        4: ("selector", "meta.LabelSelector"), 5: ("storageClassName", "string"),
        6: ("volumeMode", "string"), 7: ("dataSource", "core.TypedLocalObjectReference"),
        8: ("dataSourceRef", "core.TypedObjectReference"),
        9: ("volumeAttributesClassName", "string"),
    },
    "core.PersistentVolumeClaimTemplate": {
        1: ("metadata", "meta.ObjectMeta"), 2: ("spec", "core.PersistentVolumeClaimSpec"),
    },
    "core.PersistentVolumeClaimVolumeSource": {1: ("claimName", "string"), 2: ("readOnly", "bool")},
    "core.PhotonPersistentDiskVolumeSource": {1: ("pdID", "string"), 2: ("fsType", "string")},
    "core.Pod": {
        1: ("metadata", "meta.ObjectMeta"), 2: ("spec", "core.PodSpec"),
        3: ("status", "core.PodStatus"),
    },
    "core.PodAffinity": {
        1: ("requiredDuringSchedulingIgnoredDuringExecution", "core.PodAffinityTerm", "repeated"),
        2: ("preferredDuringSchedulingIgnoredDuringExecution", "core.WeightedPodAffinityTerm", "repeated"),
    },
    "core.PodAffinityTerm": {
        1: ("labelSelector", "meta.LabelSelector"), 2: ("namespaces", "string", "repeated"),
        3: ("topologyKey", "string"), 4: ("namespaceSelector", "meta.LabelSelector"),
        5: ("matchLabelKeys", "string", "repeated"),
        6: ("mismatchLabelKeys", "string", "repeated"),
    },
    "core.PodAntiAffinity": {
        1: ("requiredDuringSchedulingIgnoredDuringExecution", "core.PodAffinityTerm", "repeated"),
        2: ("preferredDuringSchedulingIgnoredDuringExecution", "core.WeightedPodAffinityTerm", "repeated"),
    },
    "core.PodCertificateProjection": {
        1: ("signerName", "string"), 2: ("keyType", "string"),
        3: ("maxExpirationSeconds", "int32"), 4: ("credentialBundlePath", "string"),
        5: ("keyPath", "string"), 6: ("certificateChainPath", "string"),
        7: ("userAnnotations", "string", "map"), 8: ("user", "int64"),
    },
    "core.PodCondition": {
        1: ("type", "string"), 2: ("status", "string"), 3: ("lastProbeTime", "meta.Time"),
        4: ("lastTransitionTime", "meta.Time"), 5: ("reason", "string"), 6: ("message", "string"),
        7: ("observedGeneration", "int64"),
    },
    "core.PodDNSConfig": {
        1: ("nameservers", "string", "repeated"), 2: ("searches", "string", "repeated"),
        3: ("options", "core.PodDNSConfigOption", "repeated"),
    },
    "core.PodDNSConfigOption": {1: ("name", "string"), 2: ("value", "string")},
    "core.PodExtendedResourceClaimStatus": {
        1: ("requestMappings", "core.ContainerExtendedResourceRequest", "repeated"),
        2: ("resourceClaimName", "string"),
    },
    "core.PodIP": {1: ("ip", "string")},
    "core.PodOS": {1: ("name", "string")},
    "core.PodReadinessGate": {1: ("conditionType", "string")},
    "core.PodResourceClaim": {
        1: ("name", "string"), 3: ("resourceClaimName", "string"),
        4: ("resourceClaimTemplateName", "string"),
    },
    "core.PodResourceClaimStatus": {1: ("name", "string"), 2: ("resourceClaimName", "string")},
    "core.PodSchedulingGate": {1: ("name", "string")},
    "core.PodSchedulingGroup": {1: ("podGroupName", "string")},
    "core.PodSecurityContext": {
        1: ("seLinuxOptions", "core.SELinuxOptions"), 2: ("runAsUser", "int64"),
        3: ("runAsNonRoot", "bool"), 4: ("supplementalGroups", "int64", "repeated"),
        5: ("fsGroup", "int64"), 6: ("runAsGroup", "int64"),
        7: ("sysctls", "core.Sysctl", "repeated"),
        8: ("windowsOptions", "core.WindowsSecurityContextOptions"),
        9: ("fsGroupChangePolicy", "string"), 10: ("seccompProfile", "core.SeccompProfile"),
        11: ("appArmorProfile", "core.AppArmorProfile"),
        12: ("supplementalGroupsPolicy", "string"), 13: ("seLinuxChangePolicy", "string"),
    },
    "core.PodSpec": {
        1: ("volumes", "core.Volume", "repeated"), 2: ("containers", "core.Container", "repeated"),
        3: ("restartPolicy", "string"), 4: ("terminationGracePeriodSeconds", "int64"),
        5: ("activeDeadlineSeconds", "int64"), 6: ("dnsPolicy", "string"),
        7: ("nodeSelector", "string", "map"), 8: ("serviceAccountName", "string"),
        9: ("serviceAccount", "string"), 10: ("nodeName", "string"), 11: ("hostNetwork", "bool"),
        12: ("hostPID", "bool"), 13: ("hostIPC", "bool"),
        14: ("securityContext", "core.PodSecurityContext"),
        15: ("imagePullSecrets", "core.LocalObjectReference", "repeated"),
        16: ("hostname", "string"), 17: ("subdomain", "string"), 18: ("affinity", "core.Affinity"),
        19: ("schedulerName", "string"), 20: ("initContainers", "core.Container", "repeated"),
        21: ("automountServiceAccountToken", "bool"),
        22: ("tolerations", "core.Toleration", "repeated"),
        23: ("hostAliases", "core.HostAlias", "repeated"), 24: ("priorityClassName", "string"),
        25: ("priority", "int32"), 26: ("dnsConfig", "core.PodDNSConfig"),
        27: ("shareProcessNamespace", "bool"),
        28: ("readinessGates", "core.PodReadinessGate", "repeated"),
        29: ("runtimeClassName", "string"), 30: ("enableServiceLinks", "bool"),
        31: ("preemptionPolicy", "string"), 32: ("overhead", "resource.Quantity", "map"),
        33: ("topologySpreadConstraints", "core.TopologySpreadConstraint", "repeated"),
        34: ("ephemeralContainers", "core.EphemeralContainer", "repeated"),
        35: ("setHostnameAsFQDN", "bool"), 36: ("os", "core.PodOS"), 37: ("hostUsers", "bool"),
        38: ("schedulingGates", "core.PodSchedulingGate", "repeated"),
        39: ("resourceClaims", "core.PodResourceClaim", "repeated"),
        40: ("resources", "core.ResourceRequirements"), 41: ("hostnameOverride", "string"),
        43: ("schedulingGroup", "core.PodSchedulingGroup"),
        44: ("evictionResponders", "core.EvictionResponder", "repeated"),
    },
    "core.PodStatus": {
        1: ("phase", "string"), 2: ("conditions", "core.PodCondition", "repeated"),
        3: ("message", "string"), 4: ("reason", "string"), 5: ("hostIP", "string"),
        6: ("podIP", "string"), 7: ("startTime", "meta.Time"),
        8: ("containerStatuses", "core.ContainerStatus", "repeated"), 9: ("qosClass", "string"),
        10: ("initContainerStatuses", "core.ContainerStatus", "repeated"),
        11: ("nominatedNodeName", "string"), 12: ("podIPs", "core.PodIP", "repeated"),
        13: ("ephemeralContainerStatuses", "core.ContainerStatus", "repeated"),
        14: ("resize", "string"),
        15: ("resourceClaimStatuses", "core.PodResourceClaimStatus", "repeated"),
        16: ("hostIPs", "core.HostIP", "repeated"), 17: ("observedGeneration", "int64"),
        18: ("extendedResourceClaimStatus", "core.PodExtendedResourceClaimStatus"),
        19: ("allocatedResources", "resource.Quantity", "map"),
        20: ("resources", "core.ResourceRequirements"),
        21: ("nodeAllocatableResourceClaimStatuses", "core.NodeAllocatableResourceClaimStatus", "repeated"),
        22: ("volumeHealth", "core.PodVolumeHealth", "repeated"),
    },
    "core.PodTemplateSpec": {1: ("metadata", "meta.ObjectMeta"), 2: ("spec", "core.PodSpec")},
    "core.PodVolumeHealth": {
        1: ("name", "string"), 2: ("healthConditions", "core.VolumeHealthCondition", "repeated"),
        3: ("lastTransitionTime", "meta.Time"),
    },
    "core.PortworxVolumeSource": {
        1: ("volumeID", "string"), 2: ("fsType", "string"), 3: ("readOnly", "bool"),
    },
    "core.PreferredSchedulingTerm": {
        1: ("weight", "int32"), 2: ("preference", "core.NodeSelectorTerm"),
    },
    "core.Probe": {
        1: ("handler", "core.ProbeHandler"), 2: ("initialDelaySeconds", "int32"),
        3: ("timeoutSeconds", "int32"), 4: ("periodSeconds", "int32"),
        5: ("successThreshold", "int32"), 6: ("failureThreshold", "int32"),
        7: ("terminationGracePeriodSeconds", "int64"),
    },
    "core.ProbeHandler": {
        1: ("exec", "core.ExecAction"), 2: ("httpGet", "core.HTTPGetAction"),
        3: ("tcpSocket", "core.TCPSocketAction"), 4: ("grpc", "core.GRPCAction"),
    },
    "core.ProjectedVolumeSource": {
        1: ("sources", "core.VolumeProjection", "repeated"), 2: ("defaultMode", "int32"),
        3: ("defaultUser", "int64"),
    },
    "core.QuobyteVolumeSource": {
        1: ("registry", "string"), 2: ("volume", "string"), 3: ("readOnly", "bool"),
        4: ("user", "string"), 5: ("group", "string"), 6: ("tenant", "string"),
    },
    "core.RBDVolumeSource": {
        1: ("monitors", "string", "repeated"), 2: ("image", "string"), 3: ("fsType", "string"),
        4: ("pool", "string"), 5: ("user", "string"), 6: ("keyring", "string"),
        7: ("secretRef", "core.LocalObjectReference"), 8: ("readOnly", "bool"),
    },
    "core.ResourceClaim": {1: ("name", "string"), 2: ("request", "string")},
    "core.ResourceFieldSelector": {
        1: ("containerName", "string"), 2: ("resource", "string"),
        3: ("divisor", "resource.Quantity"),
    },
    "core.ResourceHealth": {
        1: ("resourceID", "string"), 2: ("health", "string"), 6: ("message", "string"),
    },
    "core.ResourceQuota": {
        1: ("metadata", "meta.ObjectMeta"), 2: ("spec", "core.ResourceQuotaSpec"),
        3: ("status", "core.ResourceQuotaStatus"),
    },
    "core.ResourceQuotaSpec": {
        1: ("hard", "resource.Quantity", "map"), 2: ("scopes", "string", "repeated"),
        3: ("scopeSelector", "core.ScopeSelector"),
    },
    "core.ResourceQuotaStatus": {
        1: ("hard", "resource.Quantity", "map"), 2: ("used", "resource.Quantity", "map"),
    },
    "core.ResourceRequirements": {
        1: ("limits", "resource.Quantity", "map"), 2: ("requests", "resource.Quantity", "map"),
        3: ("claims", "core.ResourceClaim", "repeated"),
    },
    "core.ResourceStatus": {
        1: ("name", "string"), 2: ("resources", "core.ResourceHealth", "repeated"),
    },
    "core.SELinuxOptions": {
        1: ("user", "string"), 2: ("role", "string"), 3: ("type", "string"),
        4: ("level", "string"),
    },
    "core.ScaleIOVolumeSource": {
        1: ("gateway", "string"), 2: ("system", "string"),
        3: ("secretRef", "core.LocalObjectReference"), 4: ("sslEnabled", "bool"),
        5: ("protectionDomain", "string"), 6: ("storagePool", "string"),
        7: ("storageMode", "string"), 8: ("volumeName", "string"), 9: ("fsType", "string"),
        10: ("readOnly", "bool"),
    },
    "core.ScopeSelector": {
        1: ("matchExpressions", "core.ScopedResourceSelectorRequirement", "repeated"),
    },
    "core.ScopedResourceSelectorRequirement": {
        1: ("scopeName", "string"), 2: ("operator", "string"), 3: ("values", "string", "repeated"),
    },
    "core.SeccompProfile": {1: ("type", "string"), 2: ("localhostProfile", "string")},
    "core.Secret": {
        1: ("metadata", "meta.ObjectMeta"), 2: ("data", "bytes", "map"), 3: ("type", "string"),
        4: ("stringData", "string", "map"), 5: ("immutable", "bool"),
    },
    "core.SecretEnvSource": {
        1: ("localObjectReference", "core.LocalObjectReference"), 2: ("optional", "bool"),
    },
    "core.SecretKeySelector": {
        1: ("localObjectReference", "core.LocalObjectReference"), 2: ("key", "string"),
        3: ("optional", "bool"),
    },
    "core.SecretProjection": {
        1: ("localObjectReference", "core.LocalObjectReference"),
        2: ("items", "core.KeyToPath", "repeated"), 4: ("optional", "bool"),
    },
    "core.SecretVolumeSource": {
        1: ("secretName", "string"), 2: ("items", "core.KeyToPath", "repeated"),
        3: ("defaultMode", "int32"), 4: ("optional", "bool"), 5: ("defaultUser", "int64"),
    },
    "core.SecurityContext": {
        1: ("capabilities", "core.Capabilities"), 2: ("privileged", "bool"),
        3: ("seLinuxOptions", "core.SELinuxOptions"), 4: ("runAsUser", "int64"),
        5: ("runAsNonRoot", "bool"), 6: ("readOnlyRootFilesystem", "bool"),
        7: ("allowPrivilegeEscalation", "bool"), 8: ("runAsGroup", "int64"),
        9: ("procMount", "string"), 10: ("windowsOptions", "core.WindowsSecurityContextOptions"),
        11: ("seccompProfile", "core.SeccompProfile"),
        12: ("appArmorProfile", "core.AppArmorProfile"),
    },
    "core.ServiceAccountTokenProjection": {
        1: ("audience", "string"), 2: ("expirationSeconds", "int64"), 3: ("path", "string"),
        4: ("user", "int64"),
    },
    "core.SleepAction": {1: ("seconds", "int64")},
    "core.StorageOSVolumeSource": {
        1: ("volumeName", "string"), 2: ("volumeNamespace", "string"), 3: ("fsType", "string"),
        4: ("readOnly", "bool"), 5: ("secretRef", "core.LocalObjectReference"),
    },
    "core.Sysctl": {1: ("name", "string"), 2: ("value", "string")},
    "core.TCPSocketAction": {1: ("port", "intstr.IntOrString"), 2: ("host", "string")},
    "core.Toleration": {
        1: ("key", "string"), 2: ("operator", "string"), 3: ("value", "string"),
        4: ("effect", "string"), 5: ("tolerationSeconds", "int64"),
    },
    "core.TopologySpreadConstraint": {
        1: ("maxSkew", "int32"), 2: ("topologyKey", "string"), 3: ("whenUnsatisfiable", "string"),
        4: ("labelSelector", "meta.LabelSelector"), 5: ("minDomains", "int32"),
        6: ("nodeAffinityPolicy", "string"), 7: ("nodeTaintsPolicy", "string"),
        8: ("matchLabelKeys", "string", "repeated"),
    },
    "core.TypedLocalObjectReference": {
        1: ("apiGroup", "string"), 2: ("kind", "string"), 3: ("name", "string"),
    },
    "core.TypedObjectReference": {
        1: ("apiGroup", "string"), 2: ("kind", "string"), 3: ("name", "string"),
        4: ("namespace", "string"),
    },
    "core.Volume": {1: ("name", "string"), 2: ("volumeSource", "core.VolumeSource")},
    "core.VolumeDevice": {1: ("name", "string"), 2: ("devicePath", "string")},
    "core.VolumeHealthCondition": {
        1: ("status", "string"), 2: ("reason", "string"), 3: ("message", "string"),
    },
    "core.VolumeMount": {
        1: ("name", "string"), 2: ("readOnly", "bool"), 3: ("mountPath", "string"),
        4: ("subPath", "string"), 5: ("mountPropagation", "string"), 6: ("subPathExpr", "string"),
        7: ("recursiveReadOnly", "string"), 8: ("bindMountOptions", "string", "repeated"),
    },
    "core.VolumeMountStatus": {
        1: ("name", "string"), 2: ("mountPath", "string"), 3: ("readOnly", "bool"),
        4: ("recursiveReadOnly", "string"), 5: ("volumeStatus", "core.VolumeStatus"),
    },
    "core.VolumeProjection": {
        1: ("secret", "core.SecretProjection"), 2: ("downwardAPI", "core.DownwardAPIProjection"),
        3: ("configMap", "core.ConfigMapProjection"),
        4: ("serviceAccountToken", "core.ServiceAccountTokenProjection"),
        5: ("clusterTrustBundle", "core.ClusterTrustBundleProjection"),
        6: ("podCertificate", "core.PodCertificateProjection"),
    },
    "core.VolumeResourceRequirements": {
        1: ("limits", "resource.Quantity", "map"), 2: ("requests", "resource.Quantity", "map"),
    },
    "core.VolumeSource": {
        1: ("hostPath", "core.HostPathVolumeSource"), 2: ("emptyDir", "core.EmptyDirVolumeSource"),
        3: ("gcePersistentDisk", "core.GCEPersistentDiskVolumeSource"),
        4: ("awsElasticBlockStore", "core.AWSElasticBlockStoreVolumeSource"),
        5: ("gitRepo", "core.GitRepoVolumeSource"), 6: ("secret", "core.SecretVolumeSource"),
        7: ("nfs", "core.NFSVolumeSource"), 8: ("iscsi", "core.ISCSIVolumeSource"),
        9: ("glusterfs", "core.GlusterfsVolumeSource"),
        10: ("persistentVolumeClaim", "core.PersistentVolumeClaimVolumeSource"),
        11: ("rbd", "core.RBDVolumeSource"), 12: ("flexVolume", "core.FlexVolumeSource"),
        13: ("cinder", "core.CinderVolumeSource"), 14: ("cephfs", "core.CephFSVolumeSource"),
        15: ("flocker", "core.FlockerVolumeSource"),
        16: ("downwardAPI", "core.DownwardAPIVolumeSource"), 17: ("fc", "core.FCVolumeSource"),
        18: ("azureFile", "core.AzureFileVolumeSource"),
        19: ("configMap", "core.ConfigMapVolumeSource"),
        20: ("vsphereVolume", "core.VsphereVirtualDiskVolumeSource"),
        21: ("quobyte", "core.QuobyteVolumeSource"),
        22: ("azureDisk", "core.AzureDiskVolumeSource"),
        23: ("photonPersistentDisk", "core.PhotonPersistentDiskVolumeSource"),
        24: ("portworxVolume", "core.PortworxVolumeSource"),
        25: ("scaleIO", "core.ScaleIOVolumeSource"),
        26: ("projected", "core.ProjectedVolumeSource"),
        27: ("storageos", "core.StorageOSVolumeSource"), 28: ("csi", "core.CSIVolumeSource"),
        29: ("ephemeral", "core.EphemeralVolumeSource"), 30: ("image", "core.ImageVolumeSource"),
    },
    "core.VolumeStatus": {1: ("image", "core.ImageVolumeStatus")},
    "core.VsphereVirtualDiskVolumeSource": {
        1: ("volumePath", "string"), 2: ("fsType", "string"), 3: ("storagePolicyName", "string"),
        4: ("storagePolicyID", "string"),
    },
    "core.WeightedPodAffinityTerm": {
        1: ("weight", "int32"), 2: ("podAffinityTerm", "core.PodAffinityTerm"),
    },
    "core.WindowsSecurityContextOptions": {
        1: ("gmsaCredentialSpecName", "string"), 2: ("gmsaCredentialSpec", "string"),
        3: ("runAsUserName", "string"), 4: ("hostProcess", "bool"),
    },
    "meta.Condition": {
        1: ("type", "string"), 2: ("status", "string"), 3: ("observedGeneration", "int64"),
        4: ("lastTransitionTime", "meta.Time"), 5: ("reason", "string"), 6: ("message", "string"),
    },
    "meta.LabelSelector": {
        1: ("matchLabels", "string", "map"),
        2: ("matchExpressions", "meta.LabelSelectorRequirement", "repeated"),
    },
    "meta.LabelSelectorRequirement": {
        1: ("key", "string"), 2: ("operator", "string"), 3: ("values", "string", "repeated"),
    },
    "meta.ManagedFieldsEntry": {
        1: ("manager", "string"), 2: ("operation", "string"), 3: ("apiVersion", "string"),
        4: ("time", "meta.Time"), 6: ("fieldsType", "string"), 7: ("fieldsV1", "meta.FieldsV1"),
        8: ("subresource", "string"),
    },
    "meta.ObjectMeta": {
        1: ("name", "string"), 2: ("generateName", "string"), 3: ("namespace", "string"),
        4: ("selfLink", "string"), 5: ("uid", "string"), 6: ("resourceVersion", "string"),
        7: ("generation", "int64"), 8: ("creationTimestamp", "meta.Time"),
        9: ("deletionTimestamp", "meta.Time"), 10: ("deletionGracePeriodSeconds", "int64"),
        11: ("labels", "string", "map"), 12: ("annotations", "string", "map"),
        13: ("ownerReferences", "meta.OwnerReference", "repeated"),
        14: ("finalizers", "string", "repeated"),
        17: ("managedFields", "meta.ManagedFieldsEntry", "repeated"),
    },
    "meta.OwnerReference": {
        1: ("kind", "string"), 3: ("name", "string"), 4: ("uid", "string"),
        5: ("apiVersion", "string"), 6: ("controller", "bool"), 7: ("blockOwnerDeletion", "bool"),
    },
    "policy.PodDisruptionBudget": {
        1: ("metadata", "meta.ObjectMeta"), 2: ("spec", "policy.PodDisruptionBudgetSpec"),
        3: ("status", "policy.PodDisruptionBudgetStatus"),
    },
    "policy.PodDisruptionBudgetSpec": {
        1: ("minAvailable", "intstr.IntOrString"), 2: ("selector", "meta.LabelSelector"),
        3: ("maxUnavailable", "intstr.IntOrString"), 4: ("unhealthyPodEvictionPolicy", "string"),
    },
    "policy.PodDisruptionBudgetStatus": {
        1: ("observedGeneration", "int64"), 2: ("disruptedPods", "meta.Time", "map"),
        3: ("disruptionsAllowed", "int32"), 4: ("currentHealthy", "int32"),
        5: ("desiredHealthy", "int32"), 6: ("expectedPods", "int32"),
        7: ("conditions", "meta.Condition", "repeated"),
    },
    "runtime.TypeMeta": {1: ("apiVersion", "string"), 2: ("kind", "string")},
    "runtime.Unknown": {
        1: ("typeMeta", "runtime.TypeMeta"), 2: ("raw", "bytes"), 3: ("contentEncoding", "string"),
        4: ("contentType", "string"),
    },
    "scheduling.PriorityClass": {
        1: ("metadata", "meta.ObjectMeta"), 2: ("value", "int32"), 3: ("globalDefault", "bool"),
        4: ("description", "string"), 5: ("preemptionPolicy", "string"),
    },
}

# An ephemeral container's common part has a Container's fields, number for number.
MESSAGES["core.EphemeralContainerCommon"] = MESSAGES["core.Container"]

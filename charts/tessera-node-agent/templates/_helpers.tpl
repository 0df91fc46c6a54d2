{{/*
The tessera-node-agent chart's names for the shared templates of the tessera-lib library chart
(charts/tessera-lib), bound to this service's component (node-agent).
*/}}

{{- define "tessera-node-agent.name" -}}{{ include "tessera-lib.name" (dict "root" . "component" "node-agent" "nodeIdentity" true) }}{{- end -}}
{{- define "tessera-node-agent.fullname" -}}{{ include "tessera-lib.fullname" (dict "root" . "component" "node-agent" "nodeIdentity" true) }}{{- end -}}
{{- define "tessera-node-agent.selectorLabels" -}}{{ include "tessera-lib.selectorLabels" (dict "root" . "component" "node-agent" "nodeIdentity" true) }}{{- end -}}
{{- define "tessera-node-agent.labels" -}}{{ include "tessera-lib.labels" (dict "root" . "component" "node-agent" "nodeIdentity" true) }}{{- end -}}
{{- define "tessera-node-agent.serviceAccountName" -}}{{ include "tessera-lib.serviceAccountName" (dict "root" . "component" "node-agent" "nodeIdentity" true) }}{{- end -}}
{{- define "tessera-node-agent.image" -}}{{ include "tessera-lib.image" (dict "root" . "component" "node-agent" "nodeIdentity" true) }}{{- end -}}
{{- define "tessera-node-agent.imagePullPolicy" -}}{{ include "tessera-lib.imagePullPolicy" (dict "root" . "component" "node-agent" "nodeIdentity" true) }}{{- end -}}
{{- define "tessera-node-agent.imagePullSecrets" -}}{{ include "tessera-lib.imagePullSecrets" (dict "root" . "component" "node-agent" "nodeIdentity" true) }}{{- end -}}
{{- define "tessera-node-agent.nats" -}}{{ include "tessera-lib.nats" (dict "root" . "component" "node-agent" "nodeIdentity" true) }}{{- end -}}
{{- define "tessera-node-agent.resourceNames" -}}{{ include "tessera-lib.resourceNames" (dict "root" . "component" "node-agent" "nodeIdentity" true) }}{{- end -}}
{{- define "tessera-node-agent.schedulerName" -}}{{ include "tessera-lib.schedulerName" (dict "root" . "component" "node-agent" "nodeIdentity" true) }}{{- end -}}
{{- define "tessera-node-agent.env" -}}{{ include "tessera-lib.env" (dict "root" . "component" "node-agent" "nodeIdentity" true) }}{{- end -}}
{{- define "tessera-node-agent.natsVolumeMounts" -}}{{ include "tessera-lib.natsVolumeMounts" (dict "root" . "component" "node-agent" "nodeIdentity" true) }}{{- end -}}
{{- define "tessera-node-agent.natsVolumes" -}}{{ include "tessera-lib.natsVolumes" (dict "root" . "component" "node-agent" "nodeIdentity" true) }}{{- end -}}
{{- define "tessera-node-agent.restrictedContainerSecurityContext" -}}{{ include "tessera-lib.restrictedContainerSecurityContext" (dict "root" . "component" "node-agent" "nodeIdentity" true) }}{{- end -}}

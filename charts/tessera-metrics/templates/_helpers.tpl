{{/*
The tessera-metrics chart's names for the shared templates of the tessera-lib library chart
(charts/tessera-lib), bound to this service's component (metrics).
*/}}

{{- define "tessera-metrics.name" -}}{{ include "tessera-lib.name" (dict "root" . "component" "metrics") }}{{- end -}}
{{- define "tessera-metrics.fullname" -}}{{ include "tessera-lib.fullname" (dict "root" . "component" "metrics") }}{{- end -}}
{{- define "tessera-metrics.selectorLabels" -}}{{ include "tessera-lib.selectorLabels" (dict "root" . "component" "metrics") }}{{- end -}}
{{- define "tessera-metrics.labels" -}}{{ include "tessera-lib.labels" (dict "root" . "component" "metrics") }}{{- end -}}
{{- define "tessera-metrics.serviceAccountName" -}}{{ include "tessera-lib.serviceAccountName" (dict "root" . "component" "metrics") }}{{- end -}}
{{- define "tessera-metrics.image" -}}{{ include "tessera-lib.image" (dict "root" . "component" "metrics") }}{{- end -}}
{{- define "tessera-metrics.imagePullPolicy" -}}{{ include "tessera-lib.imagePullPolicy" (dict "root" . "component" "metrics") }}{{- end -}}
{{- define "tessera-metrics.imagePullSecrets" -}}{{ include "tessera-lib.imagePullSecrets" (dict "root" . "component" "metrics") }}{{- end -}}
{{- define "tessera-metrics.nats" -}}{{ include "tessera-lib.nats" (dict "root" . "component" "metrics") }}{{- end -}}
{{- define "tessera-metrics.resourceNames" -}}{{ include "tessera-lib.resourceNames" (dict "root" . "component" "metrics") }}{{- end -}}
{{- define "tessera-metrics.schedulerName" -}}{{ include "tessera-lib.schedulerName" (dict "root" . "component" "metrics") }}{{- end -}}
{{- define "tessera-metrics.env" -}}{{ include "tessera-lib.env" (dict "root" . "component" "metrics") }}{{- end -}}
{{- define "tessera-metrics.natsVolumeMounts" -}}{{ include "tessera-lib.natsVolumeMounts" (dict "root" . "component" "metrics") }}{{- end -}}
{{- define "tessera-metrics.natsVolumes" -}}{{ include "tessera-lib.natsVolumes" (dict "root" . "component" "metrics") }}{{- end -}}
{{- define "tessera-metrics.restrictedContainerSecurityContext" -}}{{ include "tessera-lib.restrictedContainerSecurityContext" (dict "root" . "component" "metrics") }}{{- end -}}

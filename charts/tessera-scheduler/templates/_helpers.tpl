{{/*
The tessera-scheduler chart's names for the shared templates of the tessera-lib library chart
(charts/tessera-lib), bound to this service's component (scheduler).
*/}}

{{- define "tessera-scheduler.name" -}}{{ include "tessera-lib.name" (dict "root" . "component" "scheduler") }}{{- end -}}
{{- define "tessera-scheduler.fullname" -}}{{ include "tessera-lib.fullname" (dict "root" . "component" "scheduler") }}{{- end -}}
{{- define "tessera-scheduler.selectorLabels" -}}{{ include "tessera-lib.selectorLabels" (dict "root" . "component" "scheduler") }}{{- end -}}
{{- define "tessera-scheduler.labels" -}}{{ include "tessera-lib.labels" (dict "root" . "component" "scheduler") }}{{- end -}}
{{- define "tessera-scheduler.serviceAccountName" -}}{{ include "tessera-lib.serviceAccountName" (dict "root" . "component" "scheduler") }}{{- end -}}
{{- define "tessera-scheduler.image" -}}{{ include "tessera-lib.image" (dict "root" . "component" "scheduler") }}{{- end -}}
{{- define "tessera-scheduler.imagePullPolicy" -}}{{ include "tessera-lib.imagePullPolicy" (dict "root" . "component" "scheduler") }}{{- end -}}
{{- define "tessera-scheduler.imagePullSecrets" -}}{{ include "tessera-lib.imagePullSecrets" (dict "root" . "component" "scheduler") }}{{- end -}}
{{- define "tessera-scheduler.nats" -}}{{ include "tessera-lib.nats" (dict "root" . "component" "scheduler") }}{{- end -}}
{{- define "tessera-scheduler.resourceNames" -}}{{ include "tessera-lib.resourceNames" (dict "root" . "component" "scheduler") }}{{- end -}}
{{- define "tessera-scheduler.schedulerName" -}}{{ include "tessera-lib.schedulerName" (dict "root" . "component" "scheduler") }}{{- end -}}
{{- define "tessera-scheduler.env" -}}{{ include "tessera-lib.env" (dict "root" . "component" "scheduler") }}{{- end -}}
{{- define "tessera-scheduler.natsVolumeMounts" -}}{{ include "tessera-lib.natsVolumeMounts" (dict "root" . "component" "scheduler") }}{{- end -}}
{{- define "tessera-scheduler.natsVolumes" -}}{{ include "tessera-lib.natsVolumes" (dict "root" . "component" "scheduler") }}{{- end -}}
{{- define "tessera-scheduler.restrictedContainerSecurityContext" -}}{{ include "tessera-lib.restrictedContainerSecurityContext" (dict "root" . "component" "scheduler") }}{{- end -}}

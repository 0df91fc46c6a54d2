{{/*
The tessera-quota chart's names for the shared templates of the tessera-lib library chart
(charts/tessera-lib), bound to this service's component (quota).
*/}}

{{- define "tessera-quota.name" -}}{{ include "tessera-lib.name" (dict "root" . "component" "quota") }}{{- end -}}
{{- define "tessera-quota.fullname" -}}{{ include "tessera-lib.fullname" (dict "root" . "component" "quota") }}{{- end -}}
{{- define "tessera-quota.selectorLabels" -}}{{ include "tessera-lib.selectorLabels" (dict "root" . "component" "quota") }}{{- end -}}
{{- define "tessera-quota.labels" -}}{{ include "tessera-lib.labels" (dict "root" . "component" "quota") }}{{- end -}}
{{- define "tessera-quota.serviceAccountName" -}}{{ include "tessera-lib.serviceAccountName" (dict "root" . "component" "quota") }}{{- end -}}
{{- define "tessera-quota.image" -}}{{ include "tessera-lib.image" (dict "root" . "component" "quota") }}{{- end -}}
{{- define "tessera-quota.imagePullPolicy" -}}{{ include "tessera-lib.imagePullPolicy" (dict "root" . "component" "quota") }}{{- end -}}
{{- define "tessera-quota.imagePullSecrets" -}}{{ include "tessera-lib.imagePullSecrets" (dict "root" . "component" "quota") }}{{- end -}}
{{- define "tessera-quota.nats" -}}{{ include "tessera-lib.nats" (dict "root" . "component" "quota") }}{{- end -}}
{{- define "tessera-quota.resourceNames" -}}{{ include "tessera-lib.resourceNames" (dict "root" . "component" "quota") }}{{- end -}}
{{- define "tessera-quota.schedulerName" -}}{{ include "tessera-lib.schedulerName" (dict "root" . "component" "quota") }}{{- end -}}
{{- define "tessera-quota.env" -}}{{ include "tessera-lib.env" (dict "root" . "component" "quota") }}{{- end -}}
{{- define "tessera-quota.natsVolumeMounts" -}}{{ include "tessera-lib.natsVolumeMounts" (dict "root" . "component" "quota") }}{{- end -}}
{{- define "tessera-quota.natsVolumes" -}}{{ include "tessera-lib.natsVolumes" (dict "root" . "component" "quota") }}{{- end -}}
{{- define "tessera-quota.restrictedContainerSecurityContext" -}}{{ include "tessera-lib.restrictedContainerSecurityContext" (dict "root" . "component" "quota") }}{{- end -}}

{{/*
The tessera-admission chart's names for the shared templates of the tessera-lib library chart
(charts/tessera-lib), bound to this service's component (admission).
*/}}

{{- define "tessera-admission.name" -}}{{ include "tessera-lib.name" (dict "root" . "component" "admission") }}{{- end -}}
{{- define "tessera-admission.fullname" -}}{{ include "tessera-lib.fullname" (dict "root" . "component" "admission") }}{{- end -}}
{{- define "tessera-admission.selectorLabels" -}}{{ include "tessera-lib.selectorLabels" (dict "root" . "component" "admission") }}{{- end -}}
{{- define "tessera-admission.labels" -}}{{ include "tessera-lib.labels" (dict "root" . "component" "admission") }}{{- end -}}
{{- define "tessera-admission.serviceAccountName" -}}{{ include "tessera-lib.serviceAccountName" (dict "root" . "component" "admission") }}{{- end -}}
{{- define "tessera-admission.image" -}}{{ include "tessera-lib.image" (dict "root" . "component" "admission") }}{{- end -}}
{{- define "tessera-admission.imagePullPolicy" -}}{{ include "tessera-lib.imagePullPolicy" (dict "root" . "component" "admission") }}{{- end -}}
{{- define "tessera-admission.imagePullSecrets" -}}{{ include "tessera-lib.imagePullSecrets" (dict "root" . "component" "admission") }}{{- end -}}
{{- define "tessera-admission.nats" -}}{{ include "tessera-lib.nats" (dict "root" . "component" "admission") }}{{- end -}}
{{- define "tessera-admission.resourceNames" -}}{{ include "tessera-lib.resourceNames" (dict "root" . "component" "admission") }}{{- end -}}
{{- define "tessera-admission.schedulerName" -}}{{ include "tessera-lib.schedulerName" (dict "root" . "component" "admission") }}{{- end -}}
{{- define "tessera-admission.env" -}}{{ include "tessera-lib.env" (dict "root" . "component" "admission") }}{{- end -}}
{{- define "tessera-admission.natsVolumeMounts" -}}{{ include "tessera-lib.natsVolumeMounts" (dict "root" . "component" "admission") }}{{- end -}}
{{- define "tessera-admission.natsVolumes" -}}{{ include "tessera-lib.natsVolumes" (dict "root" . "component" "admission") }}{{- end -}}
{{- define "tessera-admission.restrictedContainerSecurityContext" -}}{{ include "tessera-lib.restrictedContainerSecurityContext" (dict "root" . "component" "admission") }}{{- end -}}

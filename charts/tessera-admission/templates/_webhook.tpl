{{/*
Where the webhook's certificate comes from:
  certManager      cert-manager issues it (tls.certManager.enabled)
  existingSecret   a kubernetes.io/tls Secret you provide, with tls.caBundle
  selfProvisioned  the webhook makes its own CA and certificate, keeps them in a Secret the chart
                   creates empty, and sets the caBundle itself (the default: no prerequisite)
*/}}
{{- define "tessera-admission.tlsMode" -}}
{{- if and .Values.tls.caBundle (not .Values.tls.existingSecret) -}}
{{- fail "tls.caBundle is set but tls.existingSecret is not: give both, or neither (the webhook then makes its own certificate)" -}}
{{- end -}}
{{- if .Values.tls.certManager.enabled -}}
certManager
{{- else if .Values.tls.existingSecret -}}
existingSecret
{{- else -}}
selfProvisioned
{{- end -}}
{{- end -}}

{{- define "tessera-admission.tlsSecretName" -}}
{{- $mode := include "tessera-admission.tlsMode" . -}}
{{- if eq $mode "certManager" -}}
{{- printf "%s-tls" (include "tessera-admission.fullname" .) -}}
{{- else if eq $mode "existingSecret" -}}
{{- .Values.tls.existingSecret -}}
{{- else -}}
{{- printf "%s-certs" (include "tessera-admission.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "tessera-admission.webhookConfigurationName" -}}
{{- printf "%s-%s" (include "tessera-admission.fullname" .) .Release.Namespace | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tessera-admission.serviceDnsNames" -}}
{{- $service := include "tessera-admission.fullname" . -}}
{{- $ns := .Release.Namespace -}}
- {{ $service }}
- {{ printf "%s.%s" $service $ns }}
- {{ printf "%s.%s.svc" $service $ns }}
- {{ printf "%s.%s.svc.cluster.local" $service $ns }}
{{- end -}}

{{- define "tessera-admission.tlsSecretName" -}}
{{- if .Values.tls.certManager.enabled -}}
{{- printf "%s-tls" (include "tessera-admission.fullname" .) -}}
{{- else -}}
{{- required "tls.existingSecret is required when tls.certManager.enabled is false" .Values.tls.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "tessera-admission.serviceDnsNames" -}}
{{- $service := include "tessera-admission.fullname" . -}}
{{- $ns := .Release.Namespace -}}
- {{ $service }}
- {{ printf "%s.%s" $service $ns }}
- {{ printf "%s.%s.svc" $service $ns }}
- {{ printf "%s.%s.svc.cluster.local" $service $ns }}
{{- end -}}

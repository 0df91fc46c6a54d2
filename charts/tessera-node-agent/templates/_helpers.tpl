{{/*
Shared helpers of the tessera-node-agent chart. Every Tessera chart carries the same set under its own
prefix (template names are global across subcharts of the umbrella chart).
*/}}

{{- define "tessera-node-agent.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Release "tessera" with chart "tessera-admission" (or alias "admission" under the umbrella)
gives "tessera-admission", not "tessera-tessera-admission".
*/}}
{{- define "tessera-node-agent.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else if hasPrefix (printf "%s-" .Release.Name) $name -}}
{{- $name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "tessera-node-agent.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tessera-node-agent.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: node-agent
{{- end -}}

{{- define "tessera-node-agent.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tessera-node-agent.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tessera
{{- end -}}

{{- define "tessera-node-agent.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tessera-node-agent.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The Tessera image: global.image (umbrella) wins over this chart's image. */}}
{{- define "tessera-node-agent.image" -}}
{{- $image := mergeOverwrite (deepCopy .Values.image) ((.Values.global).image | default dict) -}}
{{- printf "%s:%s" $image.repository (toString (default .Chart.AppVersion $image.tag)) -}}
{{- end -}}

{{- define "tessera-node-agent.imagePullPolicy" -}}
{{- $image := mergeOverwrite (deepCopy .Values.image) ((.Values.global).image | default dict) -}}
{{- $image.pullPolicy | default "IfNotPresent" -}}
{{- end -}}

{{- define "tessera-node-agent.imagePullSecrets" -}}
{{- $secrets := concat (.Values.imagePullSecrets | default list) ((.Values.global).imagePullSecrets | default list) -}}
{{- if $secrets }}
imagePullSecrets:
{{- range $secrets }}
  - name: {{ . | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* NATS connection settings: global.nats (umbrella) wins over this chart's nats. */}}
{{- define "tessera-node-agent.nats" -}}
{{- toYaml (mergeOverwrite (deepCopy .Values.nats) ((.Values.global).nats | default dict)) -}}
{{- end -}}

{{/* The resource names of HAMi's API: global.resourceNames (umbrella) wins. */}}
{{- define "tessera-node-agent.resourceNames" -}}
{{- toYaml (mergeOverwrite (deepCopy .Values.resourceNames) ((.Values.global).resourceNames | default dict)) -}}
{{- end -}}

{{- define "tessera-node-agent.schedulerName" -}}
{{- (.Values.global).schedulerName | default .Values.schedulerName -}}
{{- end -}}

{{/*
Environment every Tessera service reads: the NATS connection (URL and credentials from a Secret,
the CA from a Secret), the resource names, the scheduler name and this chart's `config` map as
TESSERA_<SETTING> variables.
*/}}
{{- define "tessera-node-agent.env" -}}
{{- $nats := include "tessera-node-agent.nats" . | fromYaml -}}
{{- $auth := $nats.auth | default dict -}}
{{- $tls := $nats.tls | default dict -}}
{{- $names := include "tessera-node-agent.resourceNames" . | fromYaml -}}
{{- if and $auth.existingSecret $auth.urlKey }}
- name: NATS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $auth.existingSecret | quote }}
      key: {{ $auth.urlKey | quote }}
{{- else }}
- name: NATS_URL
  value: {{ required "nats.url: a NATS server with JetStream is required (see the chart README)" $nats.url | quote }}
{{- end }}
{{- $authType := $auth.type | default "none" }}
{{- if and (eq $authType "userPassword") (((.Values.global).nats).auth).existingSecret }}
{{- fail "global.nats.auth.existingSecret would give every service one NATS identity: leave it empty (each service reads its own Secret tessera-nats-<service>, see docs/security.md) or set each chart's nats.auth.existingSecret" }}
{{- end }}
{{- if eq $authType "userPassword" }}
{{- /* One identity per node (docs/security.md): the user names the node (TESSERA_NODE_NAME is
set before this list); the password is the node's own, from its Secret (one DaemonSet per node,
.TesseraNode) or from the node's disk. */}}
- name: NATS_USER
  value: "tessera-node-$(TESSERA_NODE_NAME)"
{{- if .TesseraNode }}
- name: NATS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ printf "tessera-nats-node-%s" .TesseraNode | quote }}
      key: {{ $auth.passwordKey | default "password" | quote }}
{{- else }}
- name: NATS_PASSWORD_FILE
  value: {{ printf "%s/password" (.Values.natsHostCredentials | default "/etc/tessera/nats") | quote }}
{{- end }}
{{- else if eq $authType "creds" }}
- name: NATS_CREDS
  value: {{ printf "/etc/tessera/nats-auth/%s" ($auth.credsKey | default "nats.creds") | quote }}
{{- else if ne $authType "none" }}
{{- fail "nats.auth.type must be none, userPassword or creds" }}
{{- end }}
{{- if $tls.enabled }}
- name: NATS_TLS_CA
  value: {{ printf "/etc/tessera/nats-tls/%s" ($tls.caKey | default "ca.crt") | quote }}
{{- end }}
- name: TESSERA_RESOURCE_NAME
  value: {{ $names.gpu | quote }}
- name: TESSERA_RESOURCE_MEM
  value: {{ $names.memory | quote }}
- name: TESSERA_RESOURCE_MEM_PERCENTAGE
  value: {{ $names.memoryPercentage | quote }}
- name: TESSERA_RESOURCE_CORES
  value: {{ $names.cores | quote }}
- name: TESSERA_RESOURCE_PRIORITY
  value: {{ $names.priority | quote }}
- name: TESSERA_SCHEDULER_NAME
  value: {{ include "tessera-node-agent.schedulerName" . | quote }}
- name: TESSERA_LOG_LEVEL
  value: {{ .Values.logLevel | default "INFO" | quote }}
{{- $config := mergeOverwrite (deepCopy (.Values.config | default dict)) ((.Values.global).config | default dict) }}
{{- range $key := keys $config | sortAlpha }}
- name: {{ printf "TESSERA_%s" ($key | snakecase | upper) }}
  value: {{ get $config $key | toString | quote }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "tessera-node-agent.natsVolumeMounts" -}}
{{- $nats := include "tessera-node-agent.nats" . | fromYaml -}}
{{- if and (eq (($nats.auth | default dict).type | default "none") "userPassword") (not .TesseraNode) }}
- name: nats-node
  mountPath: {{ .Values.natsHostCredentials | default "/etc/tessera/nats" }}
  readOnly: true
{{- end }}
{{- if eq (($nats.auth | default dict).type | default "none") "creds" }}
- name: nats-auth
  mountPath: /etc/tessera/nats-auth
  readOnly: true
{{- end }}
{{- if ($nats.tls | default dict).enabled }}
- name: nats-tls
  mountPath: /etc/tessera/nats-tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "tessera-node-agent.natsVolumes" -}}
{{- $nats := include "tessera-node-agent.nats" . | fromYaml -}}
{{- $auth := $nats.auth | default dict -}}
{{- $tls := $nats.tls | default dict -}}
{{- if and (eq ($auth.type | default "none") "userPassword") (not .TesseraNode) }}
# This node's own NATS password, provisioned on the host (docs/security.md, "Node agents").
- name: nats-node
  hostPath:
    path: {{ .Values.natsHostCredentials | default "/etc/tessera/nats" | quote }}
    type: Directory
{{- end }}
{{- if eq ($auth.type | default "none") "creds" }}
- name: nats-auth
  secret:
    secretName: {{ required "nats.auth.existingSecret is required for creds" $auth.existingSecret | quote }}
    defaultMode: 0440
    items:
      - key: {{ $auth.credsKey | default "nats.creds" | quote }}
        path: {{ $auth.credsKey | default "nats.creds" | quote }}
{{- end }}
{{- if $tls.enabled }}
- name: nats-tls
  secret:
    secretName: {{ required "nats.tls.caSecret is required when nats.tls.enabled" $tls.caSecret | quote }}
    items:
      - key: {{ $tls.caKey | default "ca.crt" | quote }}
        path: {{ $tls.caKey | default "ca.crt" | quote }}
{{- end }}
{{- end -}}

{{/* Restricted-profile container security context for the control-plane services. */}}
{{- define "tessera-node-agent.restrictedContainerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/*
Templates every Tessera chart shares (a Helm library chart: it renders nothing by itself).

Each takes a dict:
  root          the calling chart's context (`.`)
  component     the service: admission, scheduler, quota, node-agent, metrics
  nodeIdentity  true for node agents: NATS identity per node (docs/security.md, "Node agents")
Each service chart binds its component once in its own _helpers.tpl
(`tessera-<service>.<name>` -> `tessera-lib.<name>`), so its templates stay short.
*/}}

{{- define "tessera-lib.name" -}}
{{- $root := .root -}}
{{- default $root.Chart.Name $root.Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Release "tessera" with chart "tessera-admission" (or alias "admission" under the umbrella)
gives "tessera-admission", not "tessera-tessera-admission".
*/}}
{{- define "tessera-lib.fullname" -}}
{{- $root := .root -}}
{{- if $root.Values.fullnameOverride -}}
{{- $root.Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default $root.Chart.Name $root.Values.nameOverride -}}
{{- if contains $name $root.Release.Name -}}
{{- $root.Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else if hasPrefix (printf "%s-" $root.Release.Name) $name -}}
{{- $name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" $root.Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "tessera-lib.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tessera-lib.name" . }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ required "tessera-lib: component is required" .component }}
{{- end -}}

{{- define "tessera-lib.labels" -}}
{{- $root := .root -}}
helm.sh/chart: {{ printf "%s-%s" $root.Chart.Name $root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tessera-lib.selectorLabels" . }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
app.kubernetes.io/part-of: tessera
{{- end -}}

{{- define "tessera-lib.serviceAccountName" -}}
{{- $root := .root -}}
{{- if $root.Values.serviceAccount.create -}}
{{- default (include "tessera-lib.fullname" .) $root.Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" $root.Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The Tessera image: global.image (umbrella) wins over this chart's image. */}}
{{- define "tessera-lib.image" -}}
{{- $root := .root -}}
{{- $image := mergeOverwrite (deepCopy $root.Values.image) (($root.Values.global).image | default dict) -}}
{{- printf "%s:%s" $image.repository (toString (default $root.Chart.AppVersion $image.tag)) -}}
{{- end -}}

{{- define "tessera-lib.imagePullPolicy" -}}
{{- $root := .root -}}
{{- $image := mergeOverwrite (deepCopy $root.Values.image) (($root.Values.global).image | default dict) -}}
{{- $image.pullPolicy | default "IfNotPresent" -}}
{{- end -}}

{{- define "tessera-lib.imagePullSecrets" -}}
{{- $root := .root -}}
{{- $secrets := concat ($root.Values.imagePullSecrets | default list) (($root.Values.global).imagePullSecrets | default list) -}}
{{- if $secrets }}
imagePullSecrets:
{{- range $secrets }}
  - name: {{ . | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* NATS connection settings: global.nats (umbrella) wins over this chart's nats. */}}
{{- define "tessera-lib.nats" -}}
{{- $root := .root -}}
{{- toYaml (mergeOverwrite (deepCopy $root.Values.nats) (($root.Values.global).nats | default dict)) -}}
{{- end -}}

{{/* The resource names of HAMi's API: global.resourceNames (umbrella) wins. */}}
{{- define "tessera-lib.resourceNames" -}}
{{- $root := .root -}}
{{- toYaml (mergeOverwrite (deepCopy $root.Values.resourceNames) (($root.Values.global).resourceNames | default dict)) -}}
{{- end -}}

{{- define "tessera-lib.schedulerName" -}}
{{- $root := .root -}}
{{- ($root.Values.global).schedulerName | default $root.Values.schedulerName -}}
{{- end -}}

{{/*
Environment every Tessera service reads: the NATS connection (URL and credentials from a Secret,
the CA from a Secret), the resource names, the scheduler name and this chart's `config` map as
TESSERA_<SETTING> variables.
*/}}
{{- define "tessera-lib.env" -}}
{{- $root := .root -}}
{{- $nats := include "tessera-lib.nats" . | fromYaml -}}
{{- $auth := $nats.auth | default dict -}}
{{- $tls := $nats.tls | default dict -}}
{{- $names := include "tessera-lib.resourceNames" . | fromYaml -}}
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
{{- if and (eq $authType "userPassword") ((($root.Values.global).nats).auth).existingSecret }}
{{- fail "global.nats.auth.existingSecret would give every service one NATS identity: leave it empty (each service reads its own Secret tessera-nats-<service>, see docs/security.md) or set each chart's nats.auth.existingSecret" }}
{{- end }}
{{- if and (eq $authType "userPassword") .nodeIdentity }}
{{- /* One identity per node (docs/security.md): the user names the node (TESSERA_NODE_NAME is
set before this list); the password is the node's own, from its Secret (one DaemonSet per node,
.TesseraNode) or from the node's disk. */}}
- name: NATS_USER
  value: "tessera-node-$(TESSERA_NODE_NAME)"
{{- if $root.TesseraNode }}
- name: NATS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ printf "tessera-nats-node-%s" $root.TesseraNode | quote }}
      key: {{ $auth.passwordKey | default "password" | quote }}
{{- else }}
- name: NATS_PASSWORD_FILE
  value: {{ printf "%s/password" ($root.Values.natsHostCredentials | default "/etc/tessera/nats") | quote }}
{{- end }}
{{- else if eq $authType "userPassword" }}
{{- /* One identity per service (docs/security.md): its own Secret unless told otherwise. */}}
{{- $secret := $auth.existingSecret | default (printf "tessera-nats-%s" .component) }}
- name: NATS_USER
  valueFrom:
    secretKeyRef:
      name: {{ $secret | quote }}
      key: {{ $auth.userKey | default "user" | quote }}
- name: NATS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret | quote }}
      key: {{ $auth.passwordKey | default "password" | quote }}
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
{{- /* Signed commands (userPassword identities, unless nats.auth.commandSigning is false) */}}
{{- if (and (eq ((($nats.auth | default dict).type) | default "none") "userPassword") (ne (toString ($nats.auth | default dict).commandSigning) "false")) }}
{{- /* Signed commands (docs/security.md 4.6): whose keys to trust, and this identity's key,
provisioned with its password (`tessera nats-config --out`). */}}
- name: TESSERA_COMMAND_TRUST_FILE
  value: "/etc/tessera/command-trust/trust.json"
- name: TESSERA_COMMAND_KEY_FILE
{{- if and .nodeIdentity (not $root.TesseraNode) }}
  value: {{ printf "%s/command.key" ($root.Values.natsHostCredentials | default "/etc/tessera/nats") | quote }}
{{- else }}
  value: "/etc/tessera/command-key/command-key"
{{- end }}
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
  value: {{ include "tessera-lib.schedulerName" . | quote }}
- name: TESSERA_LOG_LEVEL
  value: {{ $root.Values.logLevel | default "INFO" | quote }}
{{- $config := mergeOverwrite (deepCopy ($root.Values.config | default dict)) (($root.Values.global).config | default dict) }}
{{- range $key := keys $config | sortAlpha }}
- name: {{ printf "TESSERA_%s" ($key | snakecase | upper) }}
  value: {{ get $config $key | toString | quote }}
{{- end }}
{{- with $root.Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "tessera-lib.natsVolumeMounts" -}}
{{- $root := .root -}}
{{- $nats := include "tessera-lib.nats" . | fromYaml -}}
{{- if (and (eq ((($nats.auth | default dict).type) | default "none") "userPassword") (ne (toString ($nats.auth | default dict).commandSigning) "false")) }}
- name: command-trust
  mountPath: /etc/tessera/command-trust
  readOnly: true
{{- if not (and .nodeIdentity (not $root.TesseraNode)) }}
- name: command-key
  mountPath: /etc/tessera/command-key
  readOnly: true
{{- end }}
{{- end }}
{{- if and .nodeIdentity (eq (($nats.auth | default dict).type | default "none") "userPassword") (not $root.TesseraNode) }}
- name: nats-node
  mountPath: {{ $root.Values.natsHostCredentials | default "/etc/tessera/nats" }}
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

{{- define "tessera-lib.natsVolumes" -}}
{{- $root := .root -}}
{{- $nats := include "tessera-lib.nats" . | fromYaml -}}
{{- $auth := $nats.auth | default dict -}}
{{- $tls := $nats.tls | default dict -}}
{{- if (and (eq ((($nats.auth | default dict).type) | default "none") "userPassword") (ne (toString ($nats.auth | default dict).commandSigning) "false")) }}
# Every identity's public command key (tessera nats-config --out: secrets.yaml).
- name: command-trust
  secret:
    secretName: tessera-command-trust
    items:
      - key: trust.json
        path: trust.json
{{- if not (and .nodeIdentity (not $root.TesseraNode)) }}
# This identity's own command key, beside its password.
- name: command-key
  secret:
{{- if .nodeIdentity }}
    secretName: {{ printf "tessera-nats-node-%s" $root.TesseraNode | quote }}
{{- else }}
    secretName: {{ $auth.existingSecret | default (printf "tessera-nats-%s" .component) | quote }}
{{- end }}
    defaultMode: 0440
    items:
      - key: command-key
        path: command-key
{{- end }}
{{- end }}
{{- if and .nodeIdentity (eq ($auth.type | default "none") "userPassword") (not $root.TesseraNode) }}
# This node's own NATS password, provisioned on the host (docs/security.md, "Node agents").
- name: nats-node
  hostPath:
    path: {{ $root.Values.natsHostCredentials | default "/etc/tessera/nats" | quote }}
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
{{- define "tessera-lib.restrictedContainerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

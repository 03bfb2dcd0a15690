{{/* Names, labels and the pieces every relayrl workload shares. */}}

{{/* Fixed container ports (the images, dashboards and deploy/docs rely on them). */}}
{{- define "relayrl.port.grpc" -}}50051{{- end }}
{{- define "relayrl.port.metrics" -}}9400{{- end }}
{{- define "relayrl.port.agent" -}}8080{{- end }}
{{- define "relayrl.port.http" -}}8000{{- end }}
{{- define "relayrl.port.redis" -}}6379{{- end }}
{{- define "relayrl.port.redisMetrics" -}}9121{{- end }}
{{/* The prefix of runbook_url annotations in deploy/prometheus/rules. */}}
{{- define "relayrl.upstreamRunbookBase" -}}https://github.com/relayrl/relayrl/blob/main/deploy/docs{{- end }}

{{- define "relayrl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release name if it contains the chart name, else <release>-<chart>; 63 characters. */}}
{{- define "relayrl.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* <fullname>-<component>, for a dict {root, component}. */}}
{{- define "relayrl.componentName" -}}
{{- printf "%s-%s" (include "relayrl.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "relayrl.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of the release's pods (any component). */}}
{{- define "relayrl.releaseSelectorLabels" -}}
app.kubernetes.io/name: {{ include "relayrl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Selector labels of one component, for a dict {root, component}. */}}
{{- define "relayrl.selectorLabels" -}}
{{ include "relayrl.releaseSelectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* All labels of one component's objects, for a dict {root, component}. */}}
{{- define "relayrl.labels" -}}
{{ include "relayrl.selectorLabels" . }}
app.kubernetes.io/part-of: relayrl
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
helm.sh/chart: {{ include "relayrl.chart" .root }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "relayrl.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "relayrl.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Image of a relayrl component, for a dict {root, component}. */}}
{{- define "relayrl.image" -}}
{{- $v := .root.Values }}
{{- $role := index $v .component }}
{{- $repo := $role.image | default (printf "%s/%s/%s" $v.image.registry $v.image.repository .component) }}
{{- printf "%s:%s" $repo ($v.image.tag | default .root.Chart.AppVersion) }}
{{- end }}

{{/* In-cluster DNS name of a component's Service, for a dict {root, component}. */}}
{{- define "relayrl.serviceHost" -}}
{{- printf "%s.%s.svc.%s" (include "relayrl.componentName" .) .root.Release.Namespace .root.Values.clusterDomain }}
{{- end }}

{{/* Stable DNS name of pod <index> of a StatefulSet behind a headless Service:
     dict {root, component, service, index}. */}}
{{- define "relayrl.podHost" -}}
{{- printf "%s-%d.%s.%s.svc.%s" (include "relayrl.componentName" .) (int .index) .service .root.Release.Namespace .root.Values.clusterDomain }}
{{- end }}

{{- define "relayrl.trainerHeadless" -}}
{{- printf "%s-headless" (include "relayrl.componentName" (dict "root" . "component" "trainer")) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* "true" when the component's gRPC listener serves TLS, for a dict {root, component}. */}}
{{- define "relayrl.tlsOn" -}}
{{- $tls := .root.Values.tls }}
{{- if and $tls.enabled (has .component $tls.services) }}true{{ end }}
{{- end }}

{{/* The fields of a client's `tls:` section towards a peer that serves TLS (the mounted CA,
     and the client certificate under mutual TLS), unindented: root. */}}
{{- define "relayrl.peerTlsFields" -}}
ca_file: /etc/relayrl/peer-tls/ca.crt
{{- if .Values.tls.mutual }}
cert_file: /etc/relayrl/peer-client/tls.crt
key_file: /etc/relayrl/peer-client/tls.key
{{- end }}
{{- end }}

{{/* The `tls:` lines of a client section dialling `component` (nothing when it serves
     plaintext), with their leading newline: dict {root, component}. */}}
{{- define "relayrl.peerTls" -}}
{{- if include "relayrl.tlsOn" . }}
{{- printf "\n  tls:\n%s" (include "relayrl.peerTlsFields" .root | indent 4) }}
{{- end }}
{{- end }}

{{/* What a pod that dials a TLS peer mounts: the CA (and the client certificate under mutual
     TLS). dict {root, peers: list of components it dials} */}}
{{- define "relayrl.peerTlsVolumes" -}}
{{- $root := .root }}
{{- $any := false }}
{{- range .peers }}{{ if include "relayrl.tlsOn" (dict "root" $root "component" .) }}{{ $any = true }}{{ end }}{{ end }}
{{- if $any }}
- name: peer-tls
  secret:
    secretName: {{ include "relayrl.tlsSecret" $root }}
    defaultMode: 0440
    items:
      - key: ca.crt
        path: ca.crt
{{- if $root.Values.tls.mutual }}
- name: peer-client
  secret:
    secretName: {{ $root.Values.tls.clientSecret | default (include "relayrl.tlsSecret" $root) }}
    defaultMode: 0440
{{- end }}
{{- end }}
{{- end }}

{{- define "relayrl.peerTlsMounts" -}}
{{- $root := .root }}
{{- $any := false }}
{{- range .peers }}{{ if include "relayrl.tlsOn" (dict "root" $root "component" .) }}{{ $any = true }}{{ end }}{{ end }}
{{- if $any }}
- name: peer-tls
  mountPath: /etc/relayrl/peer-tls
  readOnly: true
{{- if $root.Values.tls.mutual }}
- name: peer-client
  mountPath: /etc/relayrl/peer-client
  readOnly: true
{{- end }}
{{- end }}
{{- end }}

{{- define "relayrl.tlsSecret" -}}
{{- required "tls.existingSecret is required when tls.enabled is true (a kubernetes.io/tls Secret with ca.crt)" .Values.tls.existingSecret }}
{{- end }}

{{/* Redis URL (without password) every service uses. */}}
{{- define "relayrl.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- $scheme := ternary "rediss" "redis" (eq (include "relayrl.tlsOn" (dict "root" . "component" "redis")) "true") }}
{{- printf "%s://%s:%s/0" $scheme (include "relayrl.serviceHost" (dict "root" . "component" "redis")) (include "relayrl.port.redis" .) }}
{{- else }}
{{- required "redis.external.url is required when redis.enabled is false" .Values.redis.external.url }}
{{- end }}
{{- end }}

{{/* Secret name and key of the Redis password; empty name: no password. */}}
{{- define "relayrl.redisSecretName" -}}
{{- if .Values.redis.enabled }}
{{- .Values.redis.auth.existingSecret | default (include "relayrl.componentName" (dict "root" . "component" "redis")) }}
{{- else }}
{{- .Values.redis.external.existingSecret }}
{{- end }}
{{- end }}

{{- define "relayrl.redisSecretKey" -}}
{{- if .Values.redis.enabled }}
{{- if .Values.redis.auth.existingSecret }}{{ .Values.redis.auth.existingSecretKey }}{{ else }}redis-password{{ end }}
{{- else }}
{{- .Values.redis.external.existingSecretKey }}
{{- end }}
{{- end }}

{{/* The `tq:` section of a service config (YAML). */}}
{{- define "relayrl.tqConfig" -}}
url: {{ include "relayrl.redisUrl" . }}
{{- if include "relayrl.redisSecretName" . }}
password_env: REDIS_PASSWORD
{{- end }}
{{- if include "relayrl.tlsOn" (dict "root" . "component" "redis") }}
tls:
  {{- include "relayrl.peerTlsFields" . | nindent 2 }}
{{- end }}
namespace: {{ .Values.tq.namespace }}
partitions: {{ toJson .Values.tq.partitions }}
durability: {{ .Values.tq.durability }}
{{- end }}

{{/* grpc/metrics/logging sections shared by the four relayrl services: dict {root, component}. */}}
{{- define "relayrl.serviceBase" -}}
grpc:
  host: 0.0.0.0
  port: {{ include "relayrl.port.grpc" .root }}
  {{- if include "relayrl.tlsOn" . }}
  tls:
    cert_file: /etc/relayrl/tls/tls.crt
    key_file: /etc/relayrl/tls/tls.key
    {{- if .root.Values.tls.mutual }}
    client_ca_file: /etc/relayrl/tls/ca.crt
    require_client_cert: true
    {{- end }}
  {{- end }}
metrics:
  enabled: true
  host: 0.0.0.0
  port: {{ include "relayrl.port.metrics" .root }}
logging:
  level: {{ .root.Values.logging.level }}
  json: {{ .root.Values.logging.json }}
{{- end }}

{{/* A gRPC client section pointing at a component: dict {root, component}. */}}
{{- define "relayrl.grpcTarget" -}}
{{- printf "dns:///%s:%s" (include "relayrl.serviceHost" .) (include "relayrl.port.grpc" .root) }}
{{- end }}

{{/* Env shared by the services that use the TransferQueue. */}}
{{- define "relayrl.redisEnv" -}}
{{- $name := include "relayrl.redisSecretName" . }}
{{- if $name }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $name }}
      key: {{ include "relayrl.redisSecretKey" . }}
{{- end }}
{{- end }}

{{/* Pod-level security context of the relayrl images (uid/gid 10001). */}}
{{/* The uid every relayrl container runs as (the sandbox container aside). */}}
{{- define "relayrl.runAsUser" -}}
10001
{{- end }}

{{- define "relayrl.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ include "relayrl.runAsUser" . }}
runAsGroup: {{ include "relayrl.runAsUser" . }}
fsGroup: {{ include "relayrl.runAsUser" . }}
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "relayrl.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Arguments of the healthcheck module's TLS flags for a TLS-serving component. */}}
{{- define "relayrl.healthcheckTlsArgs" -}}
- --ca
- /etc/relayrl/tls/ca.crt
{{- if .root.Values.tls.mutual }}
- --cert
- /etc/relayrl/tls-client/tls.crt
- --key
- /etc/relayrl/tls-client/tls.key
{{- end }}
{{- end }}

{{/* One probe body checking gRPC health: dict {root, component, target}. Native grpc
     probes on the container's own port when plaintext and the target is local, else the
     healthcheck module. */}}
{{- define "relayrl.grpcProbeHandler" -}}
{{- if and (not (include "relayrl.tlsOn" .)) (not .target) }}
grpc:
  port: {{ include "relayrl.port.grpc" .root }}
{{- else }}
exec:
  command:
    - python
    - -m
    - relayrl.core.healthcheck
    - grpc
    - {{ .target | default (printf "127.0.0.1:%s" (include "relayrl.port.grpc" .root)) }}
    {{- if include "relayrl.tlsOn" . }}
    {{- include "relayrl.healthcheckTlsArgs" . | nindent 4 }}
    # The certificate names the Service, not the address dialled.
    - --server-name
    - {{ include "relayrl.serviceHost" . }}
    {{- end }}
    - --timeout-s
    - "4"
{{- end }}
{{- end }}

{{/* startup, readiness and liveness probes of a relayrl gRPC service:
     dict {root, component, target (optional), startupFailures}. */}}
{{- define "relayrl.grpcProbes" -}}
{{- $handler := include "relayrl.grpcProbeHandler" . | trim }}
startupProbe:
  {{- $handler | nindent 2 }}
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: {{ .startupFailures | default 60 }}
readinessProbe:
  {{- $handler | nindent 2 }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 3
livenessProbe:
  {{- $handler | nindent 2 }}
  periodSeconds: 20
  timeoutSeconds: 5
  failureThreshold: 6
{{- end }}

{{/* Volumes for TLS material of a component: dict {root, component}. */}}
{{- define "relayrl.tlsVolumes" -}}
{{- if include "relayrl.tlsOn" . }}
- name: tls
  secret:
    secretName: {{ include "relayrl.tlsSecret" .root }}
    defaultMode: 0440
{{- if .root.Values.tls.mutual }}
- name: tls-client
  secret:
    secretName: {{ .root.Values.tls.clientSecret | default (include "relayrl.tlsSecret" .root) }}
    defaultMode: 0440
{{- end }}
{{- end }}
{{- end }}

{{- define "relayrl.tlsMounts" -}}
{{- if include "relayrl.tlsOn" . }}
- name: tls
  mountPath: /etc/relayrl/tls
  readOnly: true
{{- if .root.Values.tls.mutual }}
- name: tls-client
  mountPath: /etc/relayrl/tls-client
  readOnly: true
{{- end }}
{{- end }}
{{- end }}

{{/* The model folder volume. */}}
{{- define "relayrl.modelVolume" -}}
- name: model
{{- if eq .Values.model.source "init" }}
  emptyDir: {}
{{- else }}
  {{- toYaml .Values.model.volume | nindent 2 }}
{{- end }}
{{- end }}

{{- define "relayrl.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.path }}
  readOnly: true
  {{- if and (ne .Values.model.source "init") .Values.model.subPath }}
  subPath: {{ .Values.model.subPath }}
  {{- end }}
{{- end }}

{{/* Init container writing the tiny seeded model (model.source init): dict {root, component}. */}}
{{- define "relayrl.modelInitContainer" -}}
{{- if eq .root.Values.model.source "init" }}
- name: model-init
  image: {{ include "relayrl.image" . }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  command:
    - relayrl
    - model
    - init
    - {{ .root.Values.model.path }}
    - --seed
    - {{ .root.Values.model.initSeed | quote }}
    - --force
  env:
    - name: HOME
      value: /tmp
  securityContext:
    {{- include "relayrl.containerSecurityContext" .root | nindent 4 }}
  resources:
    requests: {cpu: 500m, memory: 1Gi}
    limits: {cpu: "2", memory: 2Gi}
  volumeMounts:
    - name: model
      mountPath: {{ .root.Values.model.path }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end }}

{{/* Requests and limits with the role's accelerator added: dict {root, role}. */}}
{{- define "relayrl.resources" -}}
{{- $res := deepCopy (.role.resources | default dict) }}
{{- $acc := .role.accelerator | default dict }}
{{- if and $acc.resourceName (gt (int $acc.count) 0) }}
{{- $_ := set $res "requests" (merge (dict $acc.resourceName (int $acc.count)) ($res.requests | default dict)) }}
{{- $_ := set $res "limits" (merge (dict $acc.resourceName (int $acc.count)) ($res.limits | default dict)) }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/* Scheduling fields of a role's pod spec. */}}
{{- define "relayrl.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Pod spec fields every relayrl workload shares. */}}
{{- define "relayrl.podCommon" -}}
serviceAccountName: {{ include "relayrl.serviceAccountName" . }}
securityContext:
  {{- include "relayrl.podSecurityContext" . | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* A rendered service config merged with the role's `config:` overrides:
     dict {base (YAML string), overrides (map)}. */}}
{{- define "relayrl.mergeConfig" -}}
{{- $base := fromYaml .base }}
{{- if hasKey $base "Error" }}{{ fail (printf "internal: chart config does not parse: %s" $base.Error) }}{{ end }}
{{- toYaml (mustMergeOverwrite $base (deepCopy (.overrides | default dict))) }}
{{- end }}

{{/* The services' identities (security.authenticate): each of the trainer, weight-sync and
     the gateway checks its callers against tokens.yaml (digests) and calls its peers with its
     own token; relayrl.core.access says what each role may call. */}}
{{- define "relayrl.identitySecretName" -}}
{{- .Values.security.existingSecret | default (include "relayrl.componentName" (dict "root" . "component" "identities")) }}
{{- end }}

{{- define "relayrl.identityAuth" -}}
{{- if .Values.security.authenticate }}
auth:
  type: static_token
  tokens_file: /etc/relayrl/identity/tokens.yaml
{{- end }}
{{- end }}

{{/* A client section's token line, with its leading newline: dict {root, principal}. */}}
{{- define "relayrl.identityToken" -}}
{{- if .root.Values.security.authenticate }}
{{- printf "\n  token_file: /etc/relayrl/identity/%s.token" .principal }}
{{- end }}
{{- end }}

{{/* The identity volume of a pod: the digests and its own token only (an engine, which
     calls no one: principal "", the digests only). dict {root, principal} */}}
{{- define "relayrl.identityVolumes" -}}
{{- if .root.Values.security.authenticate }}
- name: identity
  secret:
    secretName: {{ include "relayrl.identitySecretName" .root }}
    defaultMode: 0440
    items:
      - key: tokens.yaml
        path: tokens.yaml
      {{- if .principal }}
      - key: {{ .principal }}.token
        path: {{ .principal }}.token
      {{- end }}
{{- end }}
{{- end }}

{{- define "relayrl.identityMounts" -}}
{{- if .root.Values.security.authenticate }}
- name: identity
  mountPath: /etc/relayrl/identity
  readOnly: true
{{- end }}
{{- end }}

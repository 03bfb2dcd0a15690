{{/* The config file of every service, as the chart wires it: fixed ports on 0.0.0.0, peers
     by their Service DNS names, the TransferQueue, the run's shared knobs; then each role's
     `config:` merged over it. tests/deploy/test_helm_chart.py runs every rendered file
     through the service's own `--print-config` validation. */}}

{{/* The rollout shape, one model that the trainer and the gateway both embed unchanged
     (relayrl.core.rollout_shape): groups per step, samples per prompt, budget, eta. */}}
{{- define "relayrl.rolloutShape" -}}
rollout_shape:
  eta: {{ .Values.training.eta | int }}
  batch_groups: {{ .Values.training.trainBatchGroups | int }}
  samples_per_prompt: {{ .Values.training.samplesPerPrompt | int }}
  max_tokens: {{ .Values.training.maxTokens | int }}
{{- end }}

{{- define "relayrl.config.gateway" -}}
{{- $ctx := dict "root" . "component" "gateway" }}
{{- $t := .Values.training }}
{{- $base := include "relayrl.serviceBase" $ctx }}
{{- $base = printf "%s%s" $base (include "relayrl.identityAuth" .) }}
{{- $base = printf "%s\ntq:\n%s" $base (include "relayrl.tqConfig" . | indent 2) }}
{{- $base = printf "%s\n%s" $base (tpl `tokenizer: {{ .Values.model.path }}
engines:
  urls: []
  kubernetes:
    service: {{ include "relayrl.componentName" (dict "root" . "component" "engine") }}
    namespace: {{ .Release.Namespace }}
    port_name: http
  {{- include "relayrl.identityToken" (dict "root" . "principal" "gateway") }}
rollout:
  partitions: [train]
{{ include "relayrl.rolloutShape" . }}
agent_http:
  enabled: true
  host: 0.0.0.0
  port: {{ include "relayrl.port.agent" . }}
  model_name: policy
{{- with .Values.gateway.agents.external }}
agents:
  external:
  {{- range $name, $agent := . }}
    {{ $name }}:
      command: {{ toJson $agent.command }}
      {{- with $agent.env }}
      env: {{ toJson . }}
      {{- end }}
      deadline_s: {{ $agent.deadlineS | default 600 | float64 }}
      max_concurrent: {{ $agent.maxConcurrent | default 8 | int }}
      {{- if $agent.serve }}
      serve: true
      {{- end }}
  {{- end }}
{{- end }}
weightsync:
  target: {{ include "relayrl.grpcTarget" (dict "root" . "component" "weightsync") }}
  {{- include "relayrl.identityToken" (dict "root" . "principal" "gateway") }}
  {{- include "relayrl.peerTls" (dict "root" . "component" "weightsync") }}` .) }}
{{- include "relayrl.mergeConfig" (dict "base" $base "overrides" .Values.gateway.config) }}
{{- end }}

{{- define "relayrl.config.reward" -}}
{{- $ctx := dict "root" . "component" "reward" }}
{{- $auth := .Values.reward.auth }}
{{- $base := include "relayrl.serviceBase" $ctx }}
{{- $base = printf "%s\ntq:\n%s" $base (include "relayrl.tqConfig" . | indent 2) }}
{{- $base = printf "%s\ntq_scorer:\n  enabled: true\n  partitions: [train]" $base }}
{{- if .Values.reward.sandbox.enabled }}
{{- $base = printf "%s\n  managers_by_data_source: {code: code}" $base }}
{{- end }}
{{- $limits := .Values.reward.tenantDefaults }}
{{- $base = printf "%s\nquota_store: redis\ntenant_defaults:\n  requests_per_minute: %d\n  tokens_per_minute: %d" $base (int64 $limits.requestsPerMinute) (int64 $limits.tokensPerMinute) }}
{{- if eq $auth.type "static_token" }}
{{- $base = printf "%s\nauth:\n  type: static_token\n  tokens_file: /etc/relayrl/tenants/%s" $base $auth.tokensKey }}
{{- else if eq $auth.type "mtls" }}
{{- if not (and .Values.tls.enabled .Values.tls.mutual (has "reward" .Values.tls.services)) }}
{{- fail "reward.auth.type mtls needs tls.enabled: true, tls.mutual: true and reward in tls.services" }}
{{- end }}
{{- $base = printf "%s\nauth:\n  type: mtls" $base }}
{{- with $auth.principals }}
{{- $base = printf "%s\n  principals: %s" $base (toJson .) }}
{{- end }}
{{- end }}
{{- if .Values.reward.sandbox.enabled }}
{{- $base = printf "%s\nmanagers:\n  naive: {type: naive}\n  code:\n    type: sandbox_remote\n    socket: %s\n    max_concurrent: %d" $base (include "relayrl.sandboxSocket" .) (int .Values.reward.sandbox.maxConcurrent) }}
{{- end }}
{{- include "relayrl.mergeConfig" (dict "base" $base "overrides" .Values.reward.config) }}
{{- end }}

{{/* The reward pod's sandbox container (reward.sandbox): it listens on a socket in a volume the
     two containers share, and takes code only from the reward container's uid. */}}
{{- define "relayrl.sandboxSocket" -}}
/run/relayrl-sandbox/sandbox.sock
{{- end }}

{{- define "relayrl.config.sandbox" -}}
{{- $s := .Values.reward.sandbox }}
{{- $base := printf "socket: %s\nallow_uids: [%d]\nsandbox:\n  time_limit_s: %v\n  memory_limit_bytes: %d\n  max_concurrent: %d\n  work_root: /tmp" (include "relayrl.sandboxSocket" .) (int (include "relayrl.runAsUser" .)) (float64 $s.timeLimitS) (int64 $s.memoryLimitBytes) (int $s.maxConcurrent) }}
{{- include "relayrl.mergeConfig" (dict "base" $base "overrides" (dict "sandbox" ($s.config | default dict))) }}
{{- end }}

{{- define "relayrl.config.weightsync" -}}
{{- $ctx := dict "root" . "component" "weightsync" }}
{{- $w := .Values.weightsync }}
{{- $base := include "relayrl.serviceBase" $ctx }}
{{- $base = printf "%s%s" $base (include "relayrl.identityAuth" .) }}
{{- /* no engine list: the gateway registers every replica it discovers */}}
{{- $base = printf "%s\nbucket_size_bytes: %d\nadvertise_target: %s:%s" $base (int64 $w.bucketSizeBytes) (include "relayrl.serviceHost" $ctx) (include "relayrl.port.grpc" .) }}
{{- $base = printf "%s\nstate_dir: /var/lib/relayrl/weightsync" $base }}
{{- if .Values.security.authenticate }}
{{- $base = printf "%s\nengines:%s" $base (include "relayrl.identityToken" (dict "root" . "principal" "weightsync")) }}
{{- end }}
{{- $base = printf "%s\ndata_plane:\n  transport: %s\n  device: %s" $base $w.transport $w.device }}
{{- if ne $w.transport "grpc" }}
{{- $base = printf "%s\n  rendezvous_port: %d" $base (int $w.rendezvousPort) }}
{{- end }}
{{- $base = printf "%s\ngateway:\n  target: %s%s%s" $base (include "relayrl.grpcTarget" (dict "root" . "component" "gateway")) (include "relayrl.identityToken" (dict "root" . "principal" "weightsync")) (include "relayrl.peerTls" (dict "root" . "component" "gateway")) }}
{{- include "relayrl.mergeConfig" (dict "base" $base "overrides" $w.config) }}
{{- end }}

{{- define "relayrl.config.trainer" -}}
{{- $ctx := dict "root" . "component" "trainer" }}
{{- $t := .Values.training }}
{{- $tr := .Values.trainer }}
{{- $base := include "relayrl.serviceBase" $ctx }}
{{- $base = printf "%s%s" $base (include "relayrl.identityAuth" .) }}
{{- $base = printf "%s\ntq:\n%s" $base (include "relayrl.tqConfig" . | indent 2) }}
{{- $base = printf "%s\n%s" $base (tpl `model:
  hf_dir: {{ .Values.model.path }}
  tensor_parallel: {{ .Values.trainer.tensorParallel }}
  data_parallel: {{ .Values.trainer.dataParallel }}
  params_dtype: {{ .Values.trainer.paramsDtype }}
optim:
  lr: {{ .Values.training.lr | float64 }}
{{ include "relayrl.rolloutShape" . }}
algorithm:
  mode: {{ .Values.training.mode }}
  parameter_sync_step: {{ .Values.training.parameterSyncStep }}
data:
  {{- $data := .Values.data }}
  {{- if $data.trainFiles }}
  {{- if not $data.volume }}
  {{- fail "data.trainFiles needs data.volume (the volume that holds the files)" }}
  {{- end }}
  {{- if or .Values.trainer.prompts.inline .Values.trainer.prompts.volume }}
  {{- fail "data.trainFiles and trainer.prompts: give one source of prompts" }}
  {{- end }}
  train_files:
    {{- range $data.trainFiles }}
    - {{ printf "%s/%s" $data.path . | quote }}
    {{- end }}
  {{- if $data.heldoutFiles }}
  heldout_files:
    {{- range $data.heldoutFiles }}
    - {{ printf "%s/%s" $data.path . | quote }}
    {{- end }}
  {{- end }}
  heldout_fraction: {{ $data.heldoutFraction | float64 }}
  {{- else if .Values.trainer.prompts.inline }}
  prompts_file: /etc/relayrl/prompts/prompts.jsonl
  {{- else if .Values.trainer.prompts.volume }}
  prompts_file: /data/prompts/{{ .Values.trainer.prompts.file }}
  {{- end }}
  partition: train
  run_id: {{ .Values.training.runId }}
checkpoint:
  dir: /checkpoints/{{ .Values.training.runId }}
  interval_steps: {{ .Values.trainer.checkpoints.intervalSteps }}
  keep: {{ .Values.trainer.checkpoints.keep }}
publish:
  type: weightsync
  target: {{ include "relayrl.grpcTarget" (dict "root" . "component" "weightsync") }}
  {{- include "relayrl.identityToken" (dict "root" . "principal" "trainer") }}
  {{- include "relayrl.peerTls" (dict "root" . "component" "weightsync") }}
gateway:
  target: {{ include "relayrl.grpcTarget" (dict "root" . "component" "gateway") }}
  {{- include "relayrl.identityToken" (dict "root" . "principal" "trainer") }}
  {{- include "relayrl.peerTls" (dict "root" . "component" "gateway") }}
total_steps: {{ .Values.training.totalSteps }}` .) }}
{{- include "relayrl.mergeConfig" (dict "base" $base "overrides" $tr.config) }}
{{- end }}

{{- define "relayrl.config.engine" -}}
{{- $e := .Values.engine }}
{{- $base := tpl `model: {{ .Values.model.path }}
served_model_name: policy
host: 0.0.0.0
port: {{ include "relayrl.port.http" . }}
device: {{ .Values.engine.device }}
dtype: {{ .Values.engine.dtype }}
max_model_len: {{ .Values.engine.maxModelLen }}
max_num_seqs: {{ .Values.engine.maxNumSeqs }}
tensor_parallel_size: {{ .Values.engine.tensorParallelSize }}
gpu_memory_utilization: {{ .Values.engine.gpuMemoryUtilization | float64 }}
cpu_kv_cache_space_gib: {{ .Values.engine.cpuKvCacheGib }}
cache_dir: /var/cache/relayrl/vllm
{{- if .Values.security.authenticate }}
callers_file: /etc/relayrl/identity/tokens.yaml
{{- end }}
{{- if include "relayrl.tlsOn" (dict "root" . "component" "weightsync") }}
{{- /* the workers pull weights from weight-sync: its CA (and client certificate) */}}
weightsync_tls:
  {{- include "relayrl.peerTlsFields" . | nindent 2 }}
{{- end }}` . }}
{{- include "relayrl.mergeConfig" (dict "base" $base "overrides" $e.config) }}
{{- end }}

{{/* Checks across values that the schema cannot express; each says what to change. */}}
{{- define "relayrl.validate" -}}
{{- $t := .Values.training }}
{{- $tr := .Values.trainer }}
{{- if and (eq $t.mode "sync") (or (ne (int $t.eta) 0) (ne (int $t.parameterSyncStep) 1)) }}
{{- fail "training.mode sync needs training.eta 0 and training.parameterSyncStep 1" }}
{{- end }}
{{- if and (eq $t.mode "colocate_async") (or (gt (int $t.eta) 1) (ne (int $t.parameterSyncStep) 1)) }}
{{- fail "training.mode colocate_async needs training.eta 0 or 1 and training.parameterSyncStep 1" }}
{{- end }}
{{- if ne (mod (int $t.trainBatchGroups) (int $t.parameterSyncStep)) 0 }}
{{- fail (printf "training.trainBatchGroups (%d) must be a multiple of training.parameterSyncStep (%d)" (int $t.trainBatchGroups) (int $t.parameterSyncStep)) }}
{{- end }}
{{- $world := mul (int $tr.tensorParallel) (int $tr.dataParallel) }}
{{- if and (gt (int $tr.replicas) 1) (ne (int $world) (int $tr.replicas)) }}
{{- fail (printf "trainer.replicas (%d) > 1 runs one rank per pod: trainer.tensorParallel x trainer.dataParallel (%d) must equal it" (int $tr.replicas) (int $world)) }}
{{- end }}
{{- if and (gt (int $tr.replicas) 1) $tr.checkpoints.enabled (not $tr.checkpoints.existingClaim) }}
{{- fail "trainer.replicas > 1 needs trainer.checkpoints.existingClaim: a ReadWriteMany PVC every rank mounts (one distributed checkpoint spans all ranks)" }}
{{- end }}
{{- if and (eq (int $tr.replicas) 1) $tr.accelerator.resourceName (gt (int $tr.accelerator.count) 0) (ne (int $tr.accelerator.count) (int $world)) }}
{{- fail (printf "trainer.accelerator.count (%d) must equal trainer.tensorParallel x trainer.dataParallel (%d): one pod runs one rank per accelerator" (int $tr.accelerator.count) (int $world)) }}
{{- end }}
{{- if and (not .Values.redis.enabled) (not .Values.redis.external.url) }}
{{- fail "redis.external.url is required when redis.enabled is false" }}
{{- end }}
{{- if and (has "redis" .Values.tls.services) (not .Values.redis.enabled) }}
{{- fail "tls.services: redis is the chart's own Redis; for an external one give a rediss:// redis.external.url (and its CA in each service's tq.tls through <service>.config)" }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.existingSecret) }}
{{- fail "tls.existingSecret is required when tls.enabled is true (a kubernetes.io/tls Secret with ca.crt)" }}
{{- end }}
{{- range $name, $token := .Values.reward.auth.tokens }}
{{- if lt (len $token) 16 }}
{{- fail (printf "reward.auth.tokens.%s must be at least 16 characters" $name) }}
{{- end }}
{{- end }}
{{- end }}

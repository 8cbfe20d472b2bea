{{/*
The documents the binaries read (DESIGN.md 4.2), rendered from values.server and values.host
with every value checked; see values.yaml for defaults and ranges.
*/}}

{{/* server.yaml: the server document of capyctl-operator. */}}
{{- define "capyctl.serverDocument" -}}
{{- $s := .Values.server | default dict -}}
{{- include "capyctl.checkKeys" (dict "value" $s "path" "server" "allowed" (list "listen" "switching" "lifecycle_defaults")) -}}
{{- $listen := $s.listen | default dict -}}
{{- include "capyctl.checkKeys" (dict "value" $listen "path" "server.listen" "allowed" (list "inference" "management")) -}}
{{- $inference := default "0.0.0.0:8080" $listen.inference -}}
{{- $management := default "0.0.0.0:7443" $listen.management -}}
{{- $_ := include "capyctl.port" (dict "value" $inference "path" "server.listen.inference") -}}
{{- $_ := include "capyctl.port" (dict "value" $management "path" "server.listen.management") -}}
{{- $sw := $s.switching | default dict -}}
{{- include "capyctl.checkKeys" (dict "value" $sw "path" "server.switching" "allowed" (list "drain_timeout" "wake_timeout")) -}}
{{- $idle := $s.lifecycle_defaults | default dict -}}
{{- include "capyctl.checkKeys" (dict "value" $idle "path" "server.lifecycle_defaults" "allowed" (list "ready_idle_timeout" "parked_idle_timeout")) -}}
# The server document of capyctl-operator, rendered by the chart from values.server.
listen:
  inference: {{ $inference | quote }}
  management: {{ $management | quote }}
  {{- if .Values.operator.tls.secretName }}
  tls:
    cert: {{ printf "%s/tls.crt" (include "capyctl.tlsDir" .) | quote }}
    key: {{ printf "%s/tls.key" (include "capyctl.tlsDir" .) | quote }}
  {{- end }}
switching:
  drain_timeout: {{ include "capyctl.duration" (dict "value" $sw.drain_timeout "default" "30s" "path" "server.switching.drain_timeout" "min" 1000 "max" 600000 "range" "1s to 600s") | quote }}
  wake_timeout: {{ include "capyctl.duration" (dict "value" $sw.wake_timeout "default" "600s" "path" "server.switching.wake_timeout" "min" 1000 "max" 3600000 "range" "1s to 3600s") | quote }}
{{- $ready := $idle.ready_idle_timeout -}}
{{- $parked := $idle.parked_idle_timeout -}}
{{- if or $ready $parked }}
lifecycle_defaults:
  {{- if $ready }}
  ready_idle_timeout: {{ include "capyctl.duration" (dict "value" $ready "path" "server.lifecycle_defaults.ready_idle_timeout" "min" 1000 "max" 604800000 "range" "1s to 168h") | quote }}
  {{- end }}
  {{- if $parked }}
  parked_idle_timeout: {{ include "capyctl.duration" (dict "value" $parked "path" "server.lifecycle_defaults.parked_idle_timeout" "min" 1000 "max" 604800000 "range" "1s to 168h") | quote }}
  {{- end }}
{{- end }}
admin_token_file: {{ include "capyctl.adminTokenFile" . | quote }}
{{- end -}}

{{/* One engine of host.engines. (dict "value" MAP "kind" "vllm" "default" (list ...)) */}}
{{- define "capyctl.engineDocument" -}}
{{- $path := printf "host.engines.%s" .kind -}}
{{- $e := .value | default dict -}}
{{- include "capyctl.checkKeys" (dict "value" $e "path" $path "allowed" (list "command" "version" "env")) -}}
{{- $command := .default -}}
{{- if not (kindIs "invalid" $e.command) -}}{{- $command = $e.command -}}{{- end -}}
{{- if or (not (kindIs "slice" $command)) (eq (len $command) 0) -}}
{{- fail (printf "%s.command: must be a list of strings: the program and its first arguments" $path) -}}
{{- end -}}
{{- range $command -}}
{{- if or (not (kindIs "string" .)) (eq (trim .) "") -}}
{{- fail (printf "%s.command: `%v` is not a non-empty string" $path .) -}}
{{- end -}}
{{- end -}}
{{ .kind }}:
  command:
    {{- range $command }}
    - {{ . | quote }}
    {{- end }}
  {{- with $e.version }}
  version: {{ toString . | quote }}
  {{- end }}
  {{- $env := $e.env | default dict -}}
  {{- if not (kindIs "map" $env) -}}
  {{- fail (printf "%s.env: must be a mapping of names to values" $path) -}}
  {{- end -}}
  {{- if $env }}
  env:
    {{- range $k, $v := $env }}
    {{ $k | quote }}: {{ toString $v | quote }}
    {{- end }}
  {{- end }}
{{- end -}}

{{/* host.yaml: the host document of every capyctl-node-agent. */}}
{{- define "capyctl.hostDocument" -}}
{{- $h := .Values.host | default dict -}}
{{- include "capyctl.checkKeys" (dict "value" $h "path" "host" "allowed" (list "resource_policy" "lifecycle" "engines" "gpus" "host_memory")) -}}
{{- $rp := $h.resource_policy | default dict -}}
{{- include "capyctl.checkKeys" (dict "value" $rp "path" "host.resource_policy" "allowed" (list "queue")) -}}
{{- $q := $rp.queue | default dict -}}
{{- include "capyctl.checkKeys" (dict "value" $q "path" "host.resource_policy.queue" "allowed" (list "admission_window" "request_deadline" "stream_idle_timeout" "max_pending_per_deployment" "max_pending_total" "max_buffered_bytes_total")) -}}
{{- $qp := "host.resource_policy.queue" -}}
{{- $window := include "capyctl.duration" (dict "value" $q.admission_window "default" "2s" "path" (printf "%s.admission_window" $qp) "min" 1 "max" 30000 "range" "1ms to 30s") -}}
{{- $deadline := include "capyctl.duration" (dict "value" $q.request_deadline "default" "600s" "path" (printf "%s.request_deadline" $qp) "min" 1 "max" 3600000 "range" "1ms to 3600s") -}}
{{- if gt (include "capyctl.durationMs" (dict "value" $window "path" "") | atoi) (include "capyctl.durationMs" (dict "value" $deadline "path" "") | atoi) -}}
{{- fail (printf "%s.admission_window: %s is above the request deadline (%s); the admission window must not be above %s.request_deadline" $qp $window $deadline $qp) -}}
{{- end -}}
{{- $buffered := $q.max_buffered_bytes_total -}}
{{- if kindIs "invalid" $buffered -}}{{- $buffered = "64MiB" -}}{{- end -}}
{{- $bytes := include "capyctl.bytes" (dict "value" $buffered "path" (printf "%s.max_buffered_bytes_total" $qp)) | atoi -}}
{{- if or (lt $bytes 1024) (gt $bytes 17179869184) -}}
{{- fail (printf "%s.max_buffered_bytes_total: %s is out of range (1KiB to 16GiB)" $qp (include "capyctl.sizeText" $buffered)) -}}
{{- end -}}
{{- $lc := $h.lifecycle | default dict -}}
{{- include "capyctl.checkKeys" (dict "value" $lc "path" "host.lifecycle" "allowed" (list "activation")) -}}
{{- $activation := default "on_demand" $lc.activation -}}
{{- if not (has $activation (list "on_demand" "explicit")) -}}
{{- fail (printf "host.lifecycle.activation: `%v` is not one of on_demand, explicit" $activation) -}}
{{- end -}}
{{- $engines := $h.engines | default dict -}}
{{- include "capyctl.checkKeys" (dict "value" $engines "path" "host.engines" "allowed" (list "vllm" "sglang" "tensorfold")) -}}
# The host document of every capyctl-node-agent, rendered by the chart from values.host. The
# host ID is the node's name (--node-name).
resource_policy:
  queue:
    admission_window: {{ $window | quote }}
    request_deadline: {{ $deadline | quote }}
    stream_idle_timeout: {{ include "capyctl.duration" (dict "value" $q.stream_idle_timeout "default" "120s" "path" (printf "%s.stream_idle_timeout" $qp) "min" 1000 "max" 3600000 "range" "1s to 3600s") | quote }}
    max_pending_per_deployment: {{ include "capyctl.uint" (dict "value" $q.max_pending_per_deployment "default" 64 "path" (printf "%s.max_pending_per_deployment" $qp) "min" 0 "max" 4096) }}
    max_pending_total: {{ include "capyctl.uint" (dict "value" $q.max_pending_total "default" 256 "path" (printf "%s.max_pending_total" $qp) "min" 0 "max" 65536) }}
    max_buffered_bytes_total: {{ include "capyctl.sizeText" $buffered | quote }}
lifecycle:
  activation: {{ $activation }}
engines:
  {{- include "capyctl.engineDocument" (dict "value" $engines.vllm "kind" "vllm" "default" (list "vllm")) | nindent 2 }}
  {{- include "capyctl.engineDocument" (dict "value" $engines.sglang "kind" "sglang" "default" (list "python3" "-m" "sglang.launch_server")) | nindent 2 }}
  {{- include "capyctl.engineDocument" (dict "value" $engines.tensorfold "kind" "tensorfold" "default" (list "tensorfold" "serve")) | nindent 2 }}
{{- $gpus := $h.gpus | default list -}}
{{- if not (kindIs "slice" $gpus) -}}
{{- fail "host.gpus: must be a list such as [{memory: 80GiB, unified: false}]" -}}
{{- end -}}
{{- if $gpus }}
gpus:
  {{- range $i, $g := $gpus }}
  {{- $gp := printf "host.gpus[%d]" $i }}
  {{- include "capyctl.checkKeys" (dict "value" $g "path" $gp "allowed" (list "memory" "unified" "uuid")) }}
  {{- if kindIs "invalid" $g.memory }}
  {{- fail (printf "%s.memory: missing; every GPU needs its memory, e.g. 80GiB" $gp) }}
  {{- end }}
  {{- if eq (include "capyctl.bytes" (dict "value" $g.memory "path" (printf "%s.memory" $gp)) | atoi) 0 }}
  {{- fail (printf "%s.memory: must be more than 0" $gp) }}
  {{- end }}
  - memory: {{ include "capyctl.sizeText" $g.memory | quote }}
    unified: {{ ternary "true" "false" (eq (toString $g.unified) "true") }}
    {{- with $g.uuid }}
    uuid: {{ toString . | quote }}
    {{- end }}
  {{- end }}
{{- end }}
{{- with $h.host_memory }}
{{- if eq (include "capyctl.bytes" (dict "value" . "path" "host.host_memory") | atoi) 0 }}
{{- fail "host.host_memory: must be more than 0" }}
{{- end }}
host_memory: {{ include "capyctl.sizeText" . | quote }}
{{- end }}
{{- end -}}

{{/*
engine-pods.yaml: how capyctl-operator builds engine Pods (images, GPU sharing, model cache),
read from CAPYCTL_ENGINE_PODS_FILE. Not a CapyCTL document of DESIGN.md 4.2: the Kubernetes
side of engines, which the server and host documents do not carry.
*/}}
{{- define "capyctl.enginePodsDocument" -}}
{{- if not (has .Values.gpu.sharing (list "runtimeClass" "devicePlugin")) -}}
{{- fail (printf "gpu.sharing: `%v` is not one of runtimeClass, devicePlugin" .Values.gpu.sharing) -}}
{{- end -}}
{{- if not (has (default "host" .Values.gpu.visibleDevices) (list "host" "all")) -}}
{{- fail (printf "gpu.visibleDevices: `%v` is not one of host, all" .Values.gpu.visibleDevices) -}}
{{- end -}}
# How capyctl-operator builds engine Pods, rendered by the chart from values.enginePods, gpu and
# modelCache.
images:
  {{- range $kind := list "vllm" "sglang" "tensorfold" }}
  {{- $img := index $.Values.enginePods.images $kind }}
  {{ $kind }}:
    image: {{ include "capyctl.image" (dict "image" $img "ctx" $ "path" (printf "enginePods.images.%s" $kind)) | quote }}
    pullPolicy: {{ default "IfNotPresent" $img.pullPolicy }}
  {{- end }}
# Labels of every engine Pod (the NetworkPolicy selects them).
labels:
  {{- include "capyctl.selectorLabels" (dict "ctx" $ "component" "engine") | nindent 2 }}
gpuSharing: {{ .Values.gpu.sharing }}
runtimeClassName: {{ .Values.gpu.runtimeClassName | quote }}
visibleDevices: {{ default "host" .Values.gpu.visibleDevices }}
resources:
  requests: {{- toYaml (.Values.enginePods.resources.requests | default dict) | nindent 4 }}
  limits: {{- toYaml (.Values.enginePods.resources.limits | default dict) | nindent 4 }}
  hostRamCopyInRequest: {{ ternary "true" "false" (ne (toString .Values.enginePods.resources.hostRamCopyInRequest) "false") }}
{{- if .Values.modelCache.enabled }}
modelCache:
  hostPath: {{ .Values.modelCache.hostPath | quote }}
  type: {{ .Values.modelCache.type | quote }}
  mountPath: {{ .Values.modelCache.mountPath | quote }}
{{- end }}
shmSize: {{ .Values.enginePods.shmSize | quote }}
priorityClassName: {{ .Values.enginePods.priorityClassName | quote }}
tolerations: {{- toYaml (.Values.enginePods.tolerations | default list) | nindent 2 }}
imagePullSecrets: {{- toYaml (.Values.imagePullSecrets | default list) | nindent 2 }}
{{- end -}}

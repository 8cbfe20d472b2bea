{{/*
Names, labels and images.
*/}}
{{- define "capyctl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "capyctl.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "capyctl.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every object; call with (dict "ctx" $ "component" "operator"). */}}
{{- define "capyctl.labels" -}}
helm.sh/chart: {{ include "capyctl.chart" .ctx }}
{{ include "capyctl.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: capyctl
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "capyctl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "capyctl.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "capyctl.operator.fullname" -}}
{{- printf "%s-operator" (include "capyctl.fullname" .) -}}
{{- end -}}

{{- define "capyctl.nodeAgent.fullname" -}}
{{- printf "%s-node-agent" (include "capyctl.fullname" .) -}}
{{- end -}}

{{- define "capyctl.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create -}}
{{- default (include "capyctl.operator.fullname" .) .Values.operator.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.operator.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "capyctl.nodeAgent.serviceAccountName" -}}
{{- if .Values.nodeAgent.serviceAccount.create -}}
{{- default (include "capyctl.nodeAgent.fullname" .) .Values.nodeAgent.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.nodeAgent.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "capyctl.leaseName" -}}
{{- default (include "capyctl.operator.fullname" .) .Values.operator.leaderElection.leaseName -}}
{{- end -}}

{{/* The label the leader sets on its own Pod; the Services select it. */}}
{{- define "capyctl.leaderLabel" -}}capyctl.io/leader{{- end -}}

{{- define "capyctl.adminTokenSecretName" -}}
{{- default (printf "%s-admin-token" (include "capyctl.fullname" .)) .Values.adminToken.existingSecret -}}
{{- end -}}

{{- define "capyctl.agentTokenSecretName" -}}
{{- default (printf "%s-agent-token" (include "capyctl.fullname" .)) .Values.agentToken.existingSecret -}}
{{- end -}}

{{/* repository:tag; call with (dict "image" .Values.x.image "ctx" $ "path" "x.image"). */}}
{{- define "capyctl.image" -}}
{{- if not .image.repository -}}
{{- fail (printf "%s.repository: must not be empty" .path) -}}
{{- end -}}
{{- printf "%s:%s" .image.repository (toString (default .ctx.Chart.AppVersion .image.tag)) -}}
{{- end -}}

{{/* Where the node agent keeps its engines' records (a hostPath, mounted at the same path). */}}
{{- define "capyctl.nodeAgent.dataDir" -}}
{{- if not .Values.nodeAgent.dataDir.hostPath -}}
{{- fail "nodeAgent.dataDir.hostPath: must not be empty; the engines' records must outlive the node agent's Pod" -}}
{{- end -}}
{{- .Values.nodeAgent.dataDir.hostPath -}}
{{- end -}}

{{/* Where the containers find their files. */}}
{{- define "capyctl.configDir" -}}/etc/capyctl{{- end -}}
{{- define "capyctl.adminTokenFile" -}}/var/run/secrets/capyctl/admin-token/token{{- end -}}
{{- define "capyctl.agentTokenFile" -}}/var/run/secrets/capyctl/agent-token/token{{- end -}}
{{- define "capyctl.tlsDir" -}}/var/run/secrets/capyctl/tls{{- end -}}

{{/* http or https, for the probes, the ServiceMonitor and the URLs in NOTES. */}}
{{- define "capyctl.scheme" -}}
{{- if .Values.operator.tls.secretName -}}https{{- else -}}http{{- end -}}
{{- end -}}

{{/*
A Secret's token: the given value, else the one already in the cluster (so that an upgrade keeps
it), else 48 random characters. Call with (dict "ctx" $ "name" SECRET "value" GIVEN).
*/}}
{{- define "capyctl.token" -}}
{{- if .value -}}
{{- .value -}}
{{- else -}}
{{- $existing := lookup "v1" "Secret" .ctx.Release.Namespace .name -}}
{{- if and $existing $existing.data (hasKey $existing.data "token") -}}
{{- index $existing.data "token" | b64dec -}}
{{- else -}}
{{- randAlphaNum 48 -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
Checks of the documents' values, with the messages of the binaries' own checks
(`<key>: <value> is out of range (<range>)`), so that `helm install` refuses what the operator
or a node agent would refuse at start.
*/}}

{{/* Fails on a key outside `allowed`. (dict "value" MAP "path" "server.listen" "allowed" (list ...)) */}}
{{- define "capyctl.checkKeys" -}}
{{- $m := .value -}}
{{- if kindIs "invalid" $m -}}{{- $m = dict -}}{{- end -}}
{{- if not (kindIs "map" $m) -}}
{{- fail (printf "%s: must be a mapping, not `%v`" .path $m) -}}
{{- end -}}
{{- range $k, $_ := $m -}}
{{- if not (has $k $.allowed) -}}
{{- fail (printf "%s.%s: unknown key; expected one of %s" $.path $k (join ", " $.allowed)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A duration's milliseconds. (dict "value" V "path" P) */}}
{{- define "capyctl.durationMs" -}}
{{- $v := .value -}}
{{- if not (kindIs "string" $v) -}}
{{- fail (printf "%s: `%v` is not a duration such as 500ms, 2s, 5m or 1h (a bare number is refused: seconds or milliseconds?)" .path $v) -}}
{{- end -}}
{{- $t := trim $v -}}
{{- if not (regexMatch "^[0-9]{1,12}(ms|s|m|h)$" $t) -}}
{{- fail (printf "%s: `%s` is not a duration such as 500ms, 2s, 5m or 1h" .path $v) -}}
{{- end -}}
{{- $factors := dict "ms" 1 "s" 1000 "m" 60000 "h" 3600000 -}}
{{- mul (regexFind "^[0-9]+" $t | atoi) (get $factors (regexFind "(ms|s|m|h)$" $t)) -}}
{{- end -}}

{{/*
A duration within bounds, printed as given (trimmed). (dict "value" V "default" D "path" P
"min" MS "max" MS "range" "1s to 600s")
*/}}
{{- define "capyctl.duration" -}}
{{- $v := .value -}}
{{- if kindIs "invalid" $v -}}{{- $v = .default -}}{{- end -}}
{{- $ms := include "capyctl.durationMs" (dict "value" $v "path" .path) | atoi -}}
{{- if or (lt $ms (int .min)) (gt $ms (int .max)) -}}
{{- fail (printf "%s: %s is out of range (%s)" .path (trim $v) .range) -}}
{{- end -}}
{{- trim $v -}}
{{- end -}}

{{/* A whole number within bounds. (dict "value" V "default" D "path" P "min" N "max" N) */}}
{{- define "capyctl.uint" -}}
{{- $v := .value -}}
{{- if kindIs "invalid" $v -}}{{- $v = .default -}}{{- end -}}
{{- if not (or (kindIs "float64" $v) (kindIs "int" $v) (kindIs "int64" $v)) -}}
{{- fail (printf "%s: `%v` is not a whole number" .path $v) -}}
{{- end -}}
{{- $i := int64 $v -}}
{{- if ne (float64 $i) (float64 $v) -}}
{{- fail (printf "%s: `%v` is not a whole number" .path $v) -}}
{{- end -}}
{{- if or (lt $i (int64 .min)) (gt $i (int64 .max)) -}}
{{- fail (printf "%s: %d is out of range (%d to %d)" .path $i (int64 .min) (int64 .max)) -}}
{{- end -}}
{{- printf "%d" $i -}}
{{- end -}}

{{/* A size's bytes. (dict "value" V "path" P) */}}
{{- define "capyctl.bytes" -}}
{{- $v := .value -}}
{{- if or (kindIs "float64" $v) (kindIs "int" $v) (kindIs "int64" $v) -}}
{{- if or (lt (float64 $v) 0.0) (ne (float64 (int64 $v)) (float64 $v)) -}}
{{- fail (printf "%s: `%v` is not a byte size such as 64MiB, 40GiB or a number of bytes" .path $v) -}}
{{- end -}}
{{- printf "%d" (int64 $v) -}}
{{- else if kindIs "string" $v -}}
{{- $t := trim $v -}}
{{- if not (regexMatch "^[0-9]{1,15}(B|KiB|MiB|GiB|TiB|KB|kB|MB|GB|TB)?$" $t) -}}
{{- fail (printf "%s: `%s` is not a byte size such as 64MiB, 40GiB or a number of bytes" .path $v) -}}
{{- end -}}
{{- $factors := dict "" 1 "B" 1 "KiB" 1024 "MiB" 1048576 "GiB" 1073741824 "TiB" 1099511627776 "KB" 1000 "kB" 1000 "MB" 1000000 "GB" 1000000000 "TB" 1000000000000 -}}
{{- mul (regexFind "^[0-9]+" $t | atoi) (get $factors (regexReplaceAll "^[0-9]+" $t "")) -}}
{{- else -}}
{{- fail (printf "%s: `%v` is not a byte size such as 64MiB, 40GiB or a number of bytes" .path $v) -}}
{{- end -}}
{{- end -}}

{{/* A size printed for a document: a string as given (trimmed), a number as bytes. */}}
{{- define "capyctl.sizeText" -}}
{{- if kindIs "string" . -}}{{- trim . -}}{{- else -}}{{- printf "%d" (int64 .) -}}{{- end -}}
{{- end -}}

{{/* IP:port (IPv6 in brackets); prints the port. (dict "value" V "path" P) */}}
{{- define "capyctl.port" -}}
{{- $v := toString .value -}}
{{- if not (regexMatch "^([0-9]{1,3}(\\.[0-9]{1,3}){3}|\\[[0-9A-Fa-f:.]+\\]):[0-9]{1,5}$" $v) -}}
{{- fail (printf "%s: `%s` is not a socket address such as 0.0.0.0:8080 or [::]:8080" .path $v) -}}
{{- end -}}
{{- $port := regexFind "[0-9]+$" $v | atoi -}}
{{- if or (lt $port 1) (gt $port 65535) -}}
{{- fail (printf "%s: port %d is out of range (1 to 65535)" .path $port) -}}
{{- end -}}
{{- $port -}}
{{- end -}}

{{- /*
The namespaces whose Deployment objects the operator reconciles besides the release namespace
(operator.watchNamespaces), checked: "" (none), "*" (every namespace), or the names separated
by commas, without the release namespace and without repeats. The operator's
CAPYCTL_WATCH_NAMESPACES, the RBAC (templates/rbac.yaml) and the management Service's
annotation capyctl.io/watch-namespaces all come from it.
*/ -}}
{{- define "capyctl.watchNamespaces" -}}
{{- $v := .Values.operator.watchNamespaces -}}
{{- if not (kindIs "slice" $v) -}}
{{- fail (printf "operator.watchNamespaces: must be a list of namespaces, or [\"*\"] for every namespace, not `%v`" $v) -}}
{{- end -}}
{{- $out := list -}}
{{- range $v -}}
{{- $ns := toString . -}}
{{- if eq $ns "*" -}}
{{- if ne (len $v) 1 -}}
{{- fail "operator.watchNamespaces: \"*\" (every namespace) cannot be combined with namespaces" -}}
{{- end -}}
{{- $out = append $out "*" -}}
{{- else if not (regexMatch "^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$" $ns) -}}
{{- fail (printf "operator.watchNamespaces: `%s` is not a namespace name (lowercase letters, digits and '-', at most 63), nor \"*\"" $ns) -}}
{{- else if and (ne $ns $.Release.Namespace) (not (has $ns $out)) -}}
{{- $out = append $out $ns -}}
{{- end -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}

{{- /* Every watched namespace, the release namespace first, or "*": the annotation's value. */ -}}
{{- define "capyctl.watchAnnotation" -}}
{{- $w := include "capyctl.watchNamespaces" . -}}
{{- if eq $w "*" -}}*{{- else -}}{{- join "," (compact (prepend (splitList "," $w) .Release.Namespace)) -}}{{- end -}}
{{- end -}}

{{- /* The operator's rules on the Deployment objects of a watched namespace besides its own. */ -}}
{{- define "capyctl.watchedRules" -}}
# Deployment objects: watched, reconciled (the finalizer by merge patch), read.
- apiGroups: [capyctl.io]
  resources: [deployments]
  verbs: [get, list, watch, patch]
# Their status: server-side apply.
- apiGroups: [capyctl.io]
  resources: [deployments/status]
  verbs: [patch]
# Their Events (a repeated one is a series: patch).
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end -}}

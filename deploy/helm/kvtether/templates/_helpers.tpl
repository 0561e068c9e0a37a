{{/* Names and labels, as `helm create` makes them. */}}
{{- define "kvtether.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvtether.fullname" -}}
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

{{- define "kvtether.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvtether.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvtether.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kvtether.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvtether
{{- end }}

{{- define "kvtether.daemonImage" -}}
{{- printf "%s:%s" .Values.daemon.image.repository (default .Chart.AppVersion .Values.daemon.image.tag) }}
{{- end }}

{{/* Mount points. None lies inside another: the runtime cannot make a mount point
     inside a read-only ConfigMap or Secret volume. */}}
{{- define "kvtether.configDir" -}}/etc/kvtether{{- end }}
{{- define "kvtether.authDir" -}}/var/run/secrets/kvtether/auth{{- end }}
{{- define "kvtether.tlsDir" -}}/var/run/secrets/kvtether/tls{{- end }}
{{- define "kvtether.engineTokenDir" -}}/var/run/secrets/kvtether/engine{{- end }}

{{/* The daemon's config file: policy, store, auth and TLS from the values, then
     daemon.config merged over them. Listen addresses, the socket and the metrics port
     are flags (they beat the file), so they are not repeated here. */}}
{{- define "kvtether.daemonConfig" -}}
{{- $params := index (.Values.daemon.policy.params | default dict) .Values.daemon.policy.name | default dict }}
{{- $config := dict "policy" (dict "name" .Values.daemon.policy.name "params" $params) "log_level" .Values.daemon.logLevel "grace_s" .Values.daemon.graceSeconds }}
{{- if and .Values.store.redisUrl (not .Values.store.redisUrlSecret.name) }}
{{- $_ := set $config "store" (dict "redis_url" .Values.store.redisUrl) }}
{{- end }}
{{- if .Values.auth.enabled }}
{{- $_ := set $config "auth" (dict "tokens_file" (printf "%s/%s" (include "kvtether.authDir" .) .Values.auth.tokensKey) "engine_scopes" .Values.auth.engineScopes) }}
{{- end }}
{{- if .Values.tls.enabled }}
{{- $tls := dict "cert_file" (printf "%s/tls.crt" (include "kvtether.tlsDir" .)) "key_file" (printf "%s/tls.key" (include "kvtether.tlsDir" .)) }}
{{- if .Values.tls.mutual }}
{{- $_ := set $tls "client_ca_file" (printf "%s/ca.crt" (include "kvtether.tlsDir" .)) }}
{{- end }}
{{- $_ := set $config "tls" $tls }}
{{- end }}
{{- toYaml (mergeOverwrite $config (deepCopy (.Values.daemon.config | default dict))) }}
{{- end }}

{{/* grpc.health.v1 over the Unix socket with the daemon image's own interpreter: the
     probe when TLS is on, which the kubelet's gRPC probe cannot speak. */}}
{{- define "kvtether.socketHealthProbe" -}}
exec:
  command:
    - python
    - -c
    - "import sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; s = g.HealthStub(grpc.insecure_channel('unix:{{ .Values.daemon.unixSocket }}')).Check(h.HealthCheckRequest(), timeout=2).status; sys.exit(s != h.HealthCheckResponse.SERVING)"
{{- end }}

{{- define "kvtether.daemonProbe" -}}
{{- if .Values.tls.enabled }}
{{- include "kvtether.socketHealthProbe" . }}
{{- else }}
grpc:
  port: {{ .Values.daemon.grpcPort }}
{{- end }}
{{- end }}

{{/* The labels that select the pods running the daemon: the chart's own in pod mode,
     targetPods.matchLabels (another chart's vLLM pods) in sidecar-only mode. */}}
{{- define "kvtether.podSelector" -}}
{{- if eq .Values.mode "sidecar-only" }}
{{- if not .Values.targetPods.matchLabels }}
{{- fail "targetPods.matchLabels: sidecar-only mode needs the labels of the pods that carry the kvtether sidecar" }}
{{- end }}
{{- toYaml .Values.targetPods.matchLabels }}
{{- else }}
{{- include "kvtether.selectorLabels" . }}
{{- end }}
{{- end }}

{{/* The label a ServiceMonitor's jobLabel reads: each Service's scrape job. */}}
{{- define "kvtether.metricsJobLabel" -}}kvtether.io/metrics-job{{- end }}

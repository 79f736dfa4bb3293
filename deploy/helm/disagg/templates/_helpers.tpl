{{/*
Names, labels and the checks of value combinations. Kept small on purpose:
anything a single template needs lives in that template.
*/}}

{{/*
The chart name. Kubernetes names and label values are at most 63 characters
(a DNS-1123 label), so every name is cut there, and a trailing "-" left by the
cut is removed (a label must end with an alphanumeric character).
*/}}
{{- define "disagg.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every object name: "<release>-<name>", or just the release name
when it already contains the chart name (so "disagg" does not become
"disagg-disagg"). Cut at 63 characters for the same reason as above.
*/}}
{{- define "disagg.fullname" -}}
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

{{/*
"<fullname>-<suffix>", the full name cut first so that the whole stays within
63 characters. Call with (dict "ctx" $ "suffix" "metrics").
*/}}
{{- define "disagg.fullnameWith" -}}
{{- $room := sub 62 (len .suffix) | int }}
{{- printf "%s-%s" (include "disagg.fullname" .ctx | trunc $room | trimSuffix "-") .suffix }}
{{- end }}

{{/* "<name>-<version>" for the helm.sh/chart label ("+" is not allowed in labels). */}}
{{- define "disagg.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels: name, instance and component only. Selectors are immutable
on Deployments, so they never carry the version or the chart label, which
change on every upgrade. Call with (dict "ctx" $ "component" "operator").
*/}}
{{- define "disagg.selectorLabels" -}}
app.kubernetes.io/name: {{ include "disagg.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The recommended app.kubernetes.io labels of every object; same call as selectorLabels. */}}
{{- define "disagg.labels" -}}
helm.sh/chart: {{ include "disagg.chart" .ctx }}
{{ include "disagg.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: disagg
{{- end }}

{{- define "disagg.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "disagg.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator image: a digest wins over a tag; the tag defaults to appVersion. */}}
{{- define "disagg.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* The namespaces that hold worker pods, as a JSON list (see workerPods.networkPolicy.namespaces). */}}
{{/*
The namespaces the operator watches, as JSON: operator.watchNamespaces, else
the release namespace, or [] (every namespace) with operator.watchAllNamespaces.
*/}}
{{- define "disagg.watchNamespaces" -}}
{{- if .Values.operator.watchNamespaces }}{{ toJson .Values.operator.watchNamespaces }}
{{- else if .Values.operator.watchAllNamespaces }}[]
{{- else }}{{ toJson (list .Release.Namespace) }}
{{- end }}
{{- end }}

{{/*
The name of a cluster-scoped object: "<fullname>-<namespace>[-<suffix>]" (the full
name cut first, the whole within 63 characters), so that
releases of the same name in two namespaces (one operator per namespace) do not
claim the same ClusterRole. Call with (dict "ctx" $ "suffix" "workloads") or
(dict "ctx" $ "suffix" "").
*/}}
{{- define "disagg.clusterScopedName" -}}
{{- $tail := .ctx.Release.Namespace }}
{{- if .suffix }}{{ $tail = printf "%s-%s" $tail .suffix }}{{ end }}
{{- $room := max 8 (sub 62 (len $tail)) | int }}
{{- printf "%s-%s" (include "disagg.fullname" .ctx | trunc $room | trimSuffix "-") $tail | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "disagg.workerNamespaces" -}}
{{- $ns := .Values.workerPods.networkPolicy.namespaces | default (include "disagg.watchNamespaces" . | fromJsonArray) | default (list .Release.Namespace) }}
{{- toJson $ns }}
{{- end }}

{{/*
Value combinations the schema cannot express. Each one fails the install with
"ERROR: ..." and what to change, instead of rendering something broken.
*/}}
{{- define "disagg.validate" -}}
{{- $v := .Values }}
{{- if and $v.operator.watchAllNamespaces $v.operator.watchNamespaces }}
{{- fail "ERROR: set operator.watchNamespaces or operator.watchAllNamespaces=true, not both" }}
{{- end }}
{{- if and (gt (int $v.operator.replicas) 1) (not $v.peering.enabled) }}
{{- fail "ERROR: operator.replicas > 1 needs peering.enabled=true: without kopf peering two operators would both reconcile every cluster" }}
{{- end }}
{{- if and (not $v.serviceAccount.create) (not $v.serviceAccount.name) }}
{{- fail "ERROR: serviceAccount.create=false needs serviceAccount.name, the existing account the operator runs as" }}
{{- end }}
{{- if lt (float64 $v.operator.autoscalerWindowSeconds) (mulf 2 (float64 $v.operator.autoscalerIntervalSeconds)) }}
{{- fail "ERROR: operator.autoscalerWindowSeconds must be at least twice operator.autoscalerIntervalSeconds: latencies and rates need two samples of each pod within the window" }}
{{- end }}
{{- if eq (int $v.metrics.port) (int $v.operator.healthPort) }}
{{- fail "ERROR: metrics.port and operator.healthPort must differ: they are two servers in one container" }}
{{- end }}
{{- if and $v.metrics.serviceMonitor.enabled $v.metrics.podMonitor.enabled }}
{{- fail "ERROR: enable metrics.serviceMonitor or metrics.podMonitor, not both: Prometheus would scrape every series twice" }}
{{- end }}
{{- if and $v.metrics.serviceMonitor.enabled (not $v.metrics.service.enabled) }}
{{- fail "ERROR: metrics.serviceMonitor.enabled needs metrics.service.enabled (it scrapes through the Service); or use metrics.podMonitor" }}
{{- end }}
{{- $pdb := $v.podDisruptionBudget }}
{{- if and $pdb.enabled (hasKey $pdb "minAvailable") (hasKey $pdb "maxUnavailable") }}
{{- fail "ERROR: set podDisruptionBudget.minAvailable or podDisruptionBudget.maxUnavailable, not both: remove one from your values" }}
{{- end }}
{{- if and $pdb.enabled (hasKey $pdb "minAvailable") }}
{{- $min := $pdb.minAvailable }}
{{- if kindIs "string" $min }}{{- /* a percentage: the API server rounds it up */}}
{{- $min = ceil (divf (mulf (float64 (trimSuffix "%" $min)) (float64 $v.operator.replicas)) 100) }}
{{- end }}
{{- if ge (int $min) (int $v.operator.replicas) }}
{{- fail "ERROR: podDisruptionBudget.minAvailable must be below operator.replicas, or no node drain could ever evict the operator" }}
{{- end }}
{{- end }}
{{- if and $v.workerPods.networkPolicy.enabled $v.operator.watchAllNamespaces (not $v.workerPods.networkPolicy.namespaces) }}
{{- fail "ERROR: with operator.watchAllNamespaces=true, list the namespaces of your worker pods in workerPods.networkPolicy.namespaces (a NetworkPolicy is namespaced: without it their gRPC, transfer and admin ports would be open), or set workerPods.networkPolicy.enabled=false" }}
{{- end }}
{{- end }}

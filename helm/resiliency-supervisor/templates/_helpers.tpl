{{/* Names and labels shared by every object of the release. */}}

{{- define "rs.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rs.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "rs.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "rs.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "rs.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rs.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rs.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "rs.workloadNamespace" -}}
{{- .Values.workloadNamespace | default .Release.Namespace -}}
{{- end -}}

{{- define "rs.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "rs.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{/* Cluster-scoped names carry the namespace: one release per namespace may share a name. */}}
{{- define "rs.clusterRoleName" -}}
{{- printf "%s-%s-nodes" .Release.Namespace (include "rs.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rs.tokenReviewRoleName" -}}
{{- printf "%s-%s-tokenreviews" .Release.Namespace (include "rs.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rs.tokensSecret" -}}
{{- .Values.auth.existingSecret | default (printf "%s-tokens" (include "rs.fullname" .)) -}}
{{- end -}}

{{- define "rs.workerSecret" -}}
{{- .Values.auth.workerSecretName | default (printf "%s-worker-token" (include "rs.fullname" .)) -}}
{{- end -}}

{{- define "rs.databaseSecret" -}}
{{- .Values.database.existingSecret | default (printf "%s-database" (include "rs.fullname" .)) -}}
{{- end -}}

{{- define "rs.hostMonitorService" -}}
{{- printf "%s-host-monitor" (include "rs.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* TLS: the Secrets, where they are mounted, and the names the certificates must hold. */}}
{{- define "rs.tlsSecret" -}}
{{- .Values.tls.existingSecret | default (printf "%s-tls" (include "rs.fullname" .)) -}}
{{- end -}}

{{- define "rs.hostMonitorTlsSecret" -}}
{{- .Values.tls.hostMonitorExistingSecret | default .Values.tls.existingSecret | default (printf "%s-tls" (include "rs.hostMonitorService" .)) -}}
{{- end -}}

{{- define "rs.scheme" -}}{{ ternary "https" "http" .Values.tls.enabled }}{{- end -}}
{{- define "rs.tlsDir" -}}/etc/resiliency-supervisor/tls{{- end -}}

{{/* The DNS name of the supervisor's Service, and of the host monitors' (which their
certificate is checked against, whatever address they are reached at). */}}
{{- define "rs.serviceName" -}}
{{- printf "%s.%s.svc" (include "rs.fullname" .) .Release.Namespace -}}
{{- end -}}

{{- define "rs.hostMonitorServiceName" -}}
{{- printf "%s.%s.svc" (include "rs.hostMonitorService" .) .Release.Namespace -}}
{{- end -}}

{{/* Where the supervisor reads its settings and its policy. */}}
{{- define "rs.configDir" -}}/etc/resiliency-supervisor{{- end -}}
{{- define "rs.policyDir" -}}/etc/resiliency-supervisor/policy{{- end -}}
{{- define "rs.dataDir" -}}/var/lib/resiliency-supervisor{{- end -}}

{{/* The policy setting: a mounted file when the policy comes from a ConfigMap. */}}
{{- define "rs.policy" -}}
{{- if or .Values.policy.existingConfigMap .Values.policy.inline -}}
{{- if not .Values.policy.className -}}
{{- fail "policy.className is required with policy.inline or policy.existingConfigMap" -}}
{{- end -}}
{{- printf "%s/%s:%s" (include "rs.policyDir" .) .Values.policy.fileName .Values.policy.className -}}
{{- else -}}
{{- .Values.policy.module -}}
{{- end -}}
{{- end -}}

{{- define "rs.policyConfigMap" -}}
{{- .Values.policy.existingConfigMap | default (printf "%s-policy" (include "rs.fullname" .)) -}}
{{- end -}}

{{/* Combinations the values schema cannot express; each fails with what to change. */}}
{{- define "rs.validate" -}}
{{- $s := .Values.supervisor -}}
{{- if and (gt (int $s.replicas) 1) (not $s.leaderElection) -}}
{{- fail "supervisor.replicas > 1 needs supervisor.leaderElection: true (else two replicas would act at once)" -}}
{{- end -}}
{{- if eq .Values.database.type "sqlite" -}}
{{- if gt (int $s.replicas) 1 -}}
{{- fail "database.type sqlite serves one replica: set supervisor.replicas: 1, or use PostgreSQL" -}}
{{- end -}}
{{- else if not (or .Values.database.url .Values.database.existingSecret) -}}
{{- fail "database.type postgresql needs database.url or database.existingSecret" -}}
{{- end -}}
{{- $t := .Values.tls -}}
{{- if and $t.enabled (not $t.existingSecret) (not $t.certManager.issuerRef.name) -}}
{{- fail "tls.enabled needs tls.existingSecret or tls.certManager.issuerRef.name (cert-manager)" -}}
{{- end -}}
{{- end -}}

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

{{- define "rs.relayService" -}}
{{- printf "%s-heartbeat-relay" (include "rs.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rs.relayServiceName" -}}
{{- printf "%s.%s.svc" (include "rs.relayService" .) .Release.Namespace -}}
{{- end -}}

{{/* Whether the heartbeat relays are deployed: only with the host monitors they serve. */}}
{{- define "rs.relayEnabled" -}}
{{- if and .Values.hostMonitor.enabled .Values.relay.enabled }}true{{ end -}}
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

{{/* The settings the chart decides, as YAML (read back with fromYaml): those of the acting
supervisor (configmap.yaml) and the base of the shadow's (shadow-configmap.yaml). The
database URL is not here: each has its own. */}}
{{- define "rs.managedSettings" -}}
{{- $managed := dict
  "backend" "kubernetes"
  "host" "0.0.0.0"
  "port" 8080
  "policy" (include "rs.policy" .)
  "kube_namespace" (include "rs.workloadNamespace" .)
  "leader_election" .Values.supervisor.leaderElection
  "host_monitor_port" .Values.hostMonitor.port
  "notification_routes" .Values.notifications.routes
-}}
{{- $identity := .Values.hostMonitor.identity }}
{{- if eq $identity.mode "kubernetes" }}
{{- $_ := set $managed "agent_auth" (ternary (list "shared" "kubernetes") (list "kubernetes") $identity.acceptSharedToken) }}
{{- $_ := set $managed "agent_kube_audience" $identity.audience }}
{{- $_ := set $managed "agent_kube_service_account" (printf "system:serviceaccount:%s:%s" .Release.Namespace (include "rs.hostMonitorService" .)) }}
{{- if include "rs.relayEnabled" . }}
{{- $_ := set $managed "agent_kube_relay_service_account" (printf "system:serviceaccount:%s:%s" .Release.Namespace (include "rs.relayService" .)) }}
{{- end }}
{{- end }}
{{- if .Values.tls.enabled }}
{{- $dir := include "rs.tlsDir" . }}
{{- $_ := set $managed "tls_cert_file" (printf "%s/tls.crt" $dir) }}
{{- $_ := set $managed "tls_key_file" (printf "%s/tls.key" $dir) }}
{{- $_ := set $managed "tls_ca_file" (printf "%s/ca.crt" $dir) }}
{{- $_ := set $managed "tls_host_monitor_server_name" (include "rs.hostMonitorServiceName" .) }}
{{- end }}
{{- toYaml $managed }}
{{- end -}}

{{/* The pod and container security contexts, and the probes, of a supervisor's pod (the
acting one and the shadow); the heartbeat relays' pods take the same security contexts. */}}
{{- define "rs.supervisorPodSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "rs.supervisorSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{- define "rs.supervisorLivenessProbe" -}}
{{- $p := .Values.supervisor.livenessProbe -}}
httpGet:
  path: /healthz
  port: http
  {{- if .Values.tls.enabled }}
  scheme: HTTPS
  {{- end }}
periodSeconds: {{ $p.periodSeconds }}
timeoutSeconds: {{ $p.timeoutSeconds }}
failureThreshold: {{ $p.failureThreshold }}
{{- end -}}

{{- define "rs.supervisorReadinessProbe" -}}
{{- $p := .Values.supervisor.readinessProbe -}}
httpGet:
  path: /readyz
  port: http
  {{- if .Values.tls.enabled }}
  scheme: HTTPS
  {{- end }}
periodSeconds: {{ $p.periodSeconds }}
timeoutSeconds: {{ $p.timeoutSeconds }}
failureThreshold: {{ $p.failureThreshold }}
{{- end -}}

{{/* The shadow supervisor (values `shadow`): a supervisor in dry run beside the acting one.
Its names end in -shadow whatever the length of the release's: never the acting one's. */}}
{{- define "rs.shadowName" -}}
{{- printf "%s-shadow" (include "rs.fullname" . | trunc 56 | trimSuffix "-") -}}
{{- end -}}

{{- define "rs.shadowServiceName" -}}
{{- printf "%s.%s.svc" (include "rs.shadowName" .) .Release.Namespace -}}
{{- end -}}

{{/* What the host monitors send their copies of the heartbeats to. */}}
{{- define "rs.shadowUrl" -}}
{{- printf "%s://%s:%v" (include "rs.scheme" .) (include "rs.shadowServiceName" .) .Values.supervisor.service.port -}}
{{- end -}}

{{/* Its cluster-scoped names (dict "root" . "suffix" "nodes"): namespace, release, suffix. */}}
{{- define "rs.shadowClusterName" -}}
{{- $prefix := printf "%s-%s" .root.Release.Namespace (include "rs.fullname" .root) -}}
{{- printf "%s-shadow-%s" ($prefix | trunc (int (sub 55 (len .suffix))) | trimSuffix "-") .suffix -}}
{{- end -}}

{{/* Its policy: shadow.policy, else the acting supervisor's (a mounted file, maybe). */}}
{{- define "rs.shadowPolicy" -}}
{{- .Values.shadow.policy | default (include "rs.policy" .) -}}
{{- end -}}

{{- define "rs.shadowMountsPolicy" -}}
{{- if and (not .Values.shadow.policy) (or .Values.policy.inline .Values.policy.existingConfigMap) -}}true{{- end -}}
{{- end -}}

{{/* Its database: PostgreSQL of its own (a URL in a Secret), else SQLite in an emptyDir. */}}
{{- define "rs.shadowPostgres" -}}
{{- if or .Values.shadow.database.url .Values.shadow.database.existingSecret -}}true{{- end -}}
{{- end -}}

{{- define "rs.shadowDatabaseSecret" -}}
{{- .Values.shadow.database.existingSecret | default (printf "%s-database" (include "rs.shadowName" .)) -}}
{{- end -}}

{{- define "rs.shadowDatabaseSecretKey" -}}
{{- ternary .Values.shadow.database.existingSecretKey "url" (not (empty .Values.shadow.database.existingSecret)) -}}
{{- end -}}

{{- define "rs.databaseSecretKey" -}}
{{- ternary .Values.database.existingSecretKey "url" (not (empty .Values.database.existingSecret)) -}}
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
{{- $sh := .Values.shadow -}}
{{- if $sh.enabled -}}
{{- if and (hasKey $sh.settings "dry_run") (not $sh.settings.dry_run) -}}
{{- fail "shadow.settings.dry_run: the shadow always runs in dry run (it must never act); leave dry_run out" -}}
{{- end -}}
{{- if eq (include "rs.serviceAccountName" .) (include "rs.shadowName" .) -}}
{{- fail (printf "serviceAccount.name %s is the shadow's ServiceAccount: the shadow must not hold the acting supervisor's permissions" (include "rs.shadowName" .)) -}}
{{- end -}}
{{- if and (eq .Values.database.type "postgresql") (include "rs.shadowPostgres" .) -}}
{{- $sameUrl := and $sh.database.url (eq $sh.database.url .Values.database.url) -}}
{{- $sameSecret := and $sh.database.existingSecret (eq (include "rs.shadowDatabaseSecret" .) (include "rs.databaseSecret" .)) (eq (include "rs.shadowDatabaseSecretKey" .) (include "rs.databaseSecretKey" .)) -}}
{{- if or $sameUrl $sameSecret -}}
{{- fail "shadow.database is the acting supervisor's database: the shadow needs its own (leave shadow.database.url and existingSecret empty for SQLite in the pod)" -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

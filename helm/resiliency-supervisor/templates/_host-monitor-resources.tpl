{{/*
The host monitor's resources, sized from its peer store (host_monitor/README.md, "Where
partner copies live"). hostMonitor.resources is the base, for everything but the peer
tier; with the peer tier on:
- memory limit: base + 32Mi of transfer buffers (1 MiB per data channel connection), and
  with storeMedium memory + storeSizeGiB: tmpfs pages are charged to the writer's memory
  cgroup. The memory request grows by storeSizeGiB too (the scheduler must count it).
  With storeMedium disk the copies' page cache is reclaimed under the limit: no more.
- CPU limit: base + what moving one copy (a third of the store: the two copies kept and
  the next one arriving) within copyWithinSeconds takes, at cpuMillisecondsPerGiB.
Quantities: memory in Mi or Gi, CPU in millicores (500m) or cores (2).
*/}}

{{- define "rs.mebibytes" -}}
{{- $q := toString . -}}
{{- if hasSuffix "Gi" $q -}}{{ mul (trimSuffix "Gi" $q | atoi) 1024 }}
{{- else if hasSuffix "Mi" $q -}}{{ trimSuffix "Mi" $q | atoi }}
{{- else -}}{{ fail (printf "hostMonitor.resources: memory %q: give it in Mi or Gi" $q) }}
{{- end -}}
{{- end -}}

{{- define "rs.millicores" -}}
{{- $q := toString . -}}
{{- if hasSuffix "m" $q -}}{{ trimSuffix "m" $q | atoi }}
{{- else if regexMatch "^[0-9]+$" $q -}}{{ mul (atoi $q) 1000 }}
{{- else -}}{{ fail (printf "hostMonitor.resources: cpu %q: give it in m or whole cores" $q) }}
{{- end -}}
{{- end -}}

{{- define "rs.hostMonitorResources" -}}
{{- $h := .Values.hostMonitor -}}
{{- $p := $h.peerTier -}}
{{- $out := deepCopy ($h.resources | default dict) -}}
{{- if $p.enabled -}}
{{- $store := ternary (mul (int $p.storeSizeGiB) 1024) 0 (eq $p.storeMedium "memory") -}}
{{- $copyCpu := add1 (div (mul (int $p.storeSizeGiB) (int $p.cpuMillisecondsPerGiB)) (mul 3 (int $p.copyWithinSeconds))) -}}
{{- $limits := $out.limits | default dict -}}
{{- $requests := $out.requests | default dict -}}
{{- with $limits.memory -}}
{{- $_ := set $limits "memory" (printf "%dMi" (add (include "rs.mebibytes" . | atoi) 32 $store)) -}}
{{- end -}}
{{- with $limits.cpu -}}
{{- $_ := set $limits "cpu" (printf "%dm" (add (include "rs.millicores" . | atoi) $copyCpu)) -}}
{{- end -}}
{{- if and $requests.memory $store -}}
{{- $_ := set $requests "memory" (printf "%dMi" (add (include "rs.mebibytes" $requests.memory | atoi) $store)) -}}
{{- end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{- define "rs.peerStoreDir" -}}
{{- $p := .Values.hostMonitor.peerTier -}}
{{- $p.storeDir | default (ternary "/dev/shm/resiliency-peer" "/var/lib/resiliency-supervisor/peer" (eq $p.storeMedium "memory")) -}}
{{- end -}}

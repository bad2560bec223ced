-- Argo CD health check for kvserve.dev/InferenceService (Lua 5.1, as Argo CD runs it).
-- Degraded wins, then anything still moving (generation not yet observed, Progressing=True,
-- fewer ready replicas than desired) is Progressing, and Ready=True is Healthy.
local hs = {}

local function conditions(status)
  local byType = {}
  if status ~= nil and status.conditions ~= nil then
    for _, c in ipairs(status.conditions) do
      if c.type ~= nil then
        byType[c.type] = c
      end
    end
  end
  return byType
end

local function isTrue(c)
  return c ~= nil and c.status == "True"
end

local function describe(c, fallback)
  if c ~= nil and c.message ~= nil and c.message ~= "" then
    return c.message
  end
  if c ~= nil and c.reason ~= nil and c.reason ~= "" then
    return c.reason
  end
  return fallback
end

local status = obj.status
if status == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the kvserve operator to report status"
  return hs
end

local cond = conditions(status)
local generation = obj.metadata and obj.metadata.generation or nil

if isTrue(cond["Degraded"]) then
  hs.status = "Degraded"
  hs.message = describe(cond["Degraded"], "InferenceService is degraded")
  return hs
end

if generation ~= nil and (status.observedGeneration == nil or status.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local ready = status.readyReplicas or 0
local desired = status.desiredReplicas or status.replicas

if isTrue(cond["Progressing"]) then
  hs.status = "Progressing"
  hs.message = describe(cond["Progressing"], "Rolling out")
  return hs
end

if desired == 0 and not isTrue(cond["Progressing"]) then
  hs.status = "Healthy"
  hs.message = "Scaled to zero"
  return hs
end

if isTrue(cond["Ready"]) then
  if desired ~= nil and ready < desired then
    hs.status = "Progressing"
    hs.message = "Scaling: " .. tostring(ready) .. "/" .. tostring(desired) .. " replicas ready"
    return hs
  end
  hs.status = "Healthy"
  local tp = status.tensorParallelSize
  hs.message = tostring(ready) .. " replicas ready" .. (tp ~= nil and (", tensor-parallel " .. tostring(tp)) or "")
  return hs
end

hs.status = "Progressing"
hs.message = describe(cond["Ready"], "Waiting for ready replicas")
return hs
